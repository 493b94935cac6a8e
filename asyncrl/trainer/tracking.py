"""Where training metrics go: JSONL, TensorBoard, a periodic PNG plot, and the latest snapshot.

Owns: the on-disk metric records of a run. Components return metrics as data
(`component/metric` names); only this module writes them.
Must never: block the loop for long (writes are small and local), or drop a record silently.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

PLOTTED = ("train/reward_mean", "eval/accuracy", "buffer/staleness_mean")


class MetricsTracker:
    """Append-only metrics of one run: `metrics.jsonl`, TensorBoard events, `curves.png`."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, jsonl: bool = True, plot_interval_steps: int = 5) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._plot_interval = plot_interval_steps
        self._history: dict[str, list[tuple[int, float]]] = {k: [] for k in PLOTTED}
        self.latest: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        self.latest.update(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
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


def _finite(value: Any) -> Any:
    # JSON has no NaN; keep the record valid and the absence explicit.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
