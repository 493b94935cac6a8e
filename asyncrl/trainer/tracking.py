"""Where training metrics go: JSONL, TensorBoard, Weights & Biases, a periodic PNG plot, and the latest snapshot.

Owns: the metric records of a run, on disk and in W&B (the same scalars everywhere, and the run's
config). Components return metrics as data (`component/metric` names); only this module writes them.
Must never: block the loop for long (writes are small and local; W&B uploads from its own
process), drop a record silently, or import wandb unless logging.wandb is set.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from asyncrl.config import WandbConfig

PLOTTED = ("train/reward_mean", "eval/accuracy", "buffer/staleness_mean")


class MetricsTracker:
    """Append-only metrics of one run: `metrics.jsonl`, TensorBoard events, `curves.png`."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, jsonl: bool = True, plot_interval_steps: int = 5,
                 wandb: WandbConfig | None = None, config: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            if config is not None:  # TensorBoard's text tab: the run's whole config, as YAML
                import yaml

                self._tb.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)
        self._wandb = _open_wandb(wandb, self.run_dir, config) if wandb is not None else None
        self._plot_interval = plot_interval_steps
        self._history: dict[str, list[tuple[int, float]]] = {k: [] for k in PLOTTED}
        self.latest: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        self.latest.update(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        for key in PLOTTED:
            if key in metrics and math.isfinite(metrics[key]):
                self._history[key].append((step, float(metrics[key])))
        if self._plot_interval and step % self._plot_interval == 0:
            self.plot()

    def log_batch(self, step: int, samples: list[Any]) -> None:
        """One line per trained batch in `batches.jsonl`: which prompts, and a digest of the
        exact tokens, so two runs (or a run and its resume) can be compared batch by batch."""
        h = hashlib.sha256()
        for s in samples:
            h.update(repr((s.prompt_index, list(s.prompt_ids), list(s.response_ids))).encode())
        record = {"step": step, "prompt_indices": [s.prompt_index for s in samples], "tokens_sha256": h.hexdigest()}
        with (self.run_dir / "batches.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def plot(self, path: str | Path | None = None) -> Path:
        """Reward, held-out accuracy and staleness against learner step, as one PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path) if path else self.run_dir / "curves.png"
        fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
        for ax, key in zip(axes, PLOTTED):
            points = self._history[key]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None)
            ax.set_title(key)
            ax.set_xlabel("learner step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        tmp.replace(path)
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # wandb 0.31's finish() can return before its core process has written the run's
            # records (seen: an offline run file holding only its header); teardown waits for it.
            wandb.teardown()
            self._wandb = None


def _open_wandb(cfg: WandbConfig, run_dir: Path, config: dict[str, Any] | None) -> Any:
    """A W&B run for this app start, its files under `run_dir`/wandb."""
    try:
        import wandb
    except ImportError:
        raise ImportError("logging.wandb is set but the `wandb` package is missing: pip install 'asyncrl[wandb]' "
                          "(or unset logging.wandb)") from None
    return wandb.init(project=cfg.project, name=cfg.name, tags=list(cfg.tags) or None, mode=cfg.mode, dir=str(run_dir),
                      config=config, **cfg.init_kwargs)


def _finite(value: Any) -> Any:
    # JSON has no NaN; keep the record valid and the absence explicit.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
