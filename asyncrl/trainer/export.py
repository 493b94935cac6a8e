"""`asyncrl export RUN_DIR --out HF_DIR [--peft-out DIR]`: a run's actor checkpoint as a Hugging Face directory.

Owns: finding the checkpoint to export in what a user points at (a run's logging directory, its
checkpoint directory, or one `step_N` checkpoint), choosing the newest complete one or a named
step, and finding the model's config and tokenizer files. The conversion itself is the learner's
(`asyncrl.learner.convert_cli.mcore_to_hf`: Megatron dist checkpoint, any saved layout -> safetensors).

Must never: load a checkpoint that is being written (`step_N.tmp`) or guess a model config: a
checkpoint that does not record its model needs `--hf-config`.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.trainer.parts import CHECKPOINT_STATE, complete_checkpoints

RUN_RECORD = "run.json"  # written by the trainer into logging.dir: where the run's checkpoints are


class ExportError(ValueError):
    """What was given does not lead to an exportable checkpoint; the message says what was looked for."""


def _checkpoint_roots(run_dir: Path) -> list[Path]:
    """Directories under `run_dir` that may hold `step_N` checkpoints, most specific first."""
    roots = []
    record = run_dir / RUN_RECORD
    if record.is_file():
        try:
            roots.append(Path(json.loads(record.read_text())["checkpoint_dir"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ExportError(f"{record} is not a run record: {err!r}") from None
    roots.append(run_dir)
    roots += sorted(p for p in run_dir.iterdir() if p.is_dir() and any(p.glob(f"step_*/{CHECKPOINT_STATE}")))
    return roots


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The `step_N` directory to export: the newest complete checkpoint of the run, or step `step`.

    `run_dir` may be the run's logging directory (its `run.json` names the checkpoint directory;
    else a subdirectory holding `step_N` checkpoints is used), the checkpoint directory itself,
    or one checkpoint (`.../step_000300`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {run_dir} is not a directory")
    if (run_dir / CHECKPOINT_STATE).is_file():
        version = json.loads((run_dir / CHECKPOINT_STATE).read_text())["version"]
        if step is not None and step != version:
            raise ExportError(f"{run_dir} is the checkpoint of step {version}, not --step {step}")
        return run_dir
    for root in _checkpoint_roots(run_dir):
        found = complete_checkpoints(root) if root.is_dir() else []
        if not found:
            continue
        if step is None:
            return found[-1]
        by_step = {int(json.loads((p / CHECKPOINT_STATE).read_text())["version"]): p for p in found}
        if step not in by_step:
            raise ExportError(f"no complete checkpoint of step {step} under {root}; there are steps {sorted(by_step)}")
        return by_step[step]
    raise ExportError(f"no complete checkpoint (step_N/{CHECKPOINT_STATE}) in {run_dir} or its subdirectories; "
                      "checkpoints are written every checkpoint.interval_steps (0 = never)")


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, hf_config: str | Path | None = None,
               tp: int = 1, pp: int = 1, ep: int = 1, peft_out: str | Path | None = None) -> tuple[Path, Path]:
    """Convert the chosen actor checkpoint of a run into a Hugging Face directory at `out`
    (safetensors, the model's config, generation config and tokenizer files). Returns (the
    checkpoint exported, `out`)."""
    from asyncrl.learner.convert_cli import mcore_to_hf

    ckpt = find_checkpoint(run_dir, step)
    state = json.loads((ckpt / CHECKPOINT_STATE).read_text())
    model_dir = Path(hf_config) if hf_config else Path(state["model_path"]) if state.get("model_path") else None
    if model_dir is None:
        raise ExportError(f"{ckpt / CHECKPOINT_STATE} does not name the model (a checkpoint older than the export "
                          "command); pass --hf-config MODEL_DIR (the Hugging Face directory the run trained)")
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"model directory {model_dir} has no config.json"
                          + ("" if hf_config else f" (named by {ckpt / CHECKPOINT_STATE}; pass --hf-config to use another)"))
    actor = ckpt / "actor"
    if not (actor / "metadata.json").is_file():
        raise ExportError(f"{ckpt} has no actor checkpoint ({actor}/metadata.json missing)")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ExportError(f"--out {out} exists and is not empty (nor a model directory to overwrite)")
    try:  # (a LoRA run's actor: merged weights in `out`, and its adapters in `peft_out` where asked)
        mcore_to_hf(str(actor), str(out), str(model_dir), tp=tp, pp=pp, ep=ep,
                    peft_out=None if peft_out is None else str(peft_out))
    except ValueError as err:
        raise ExportError(str(err)) from None
    (out / "asyncrl_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt.absolute()), "policy_version": state["version"], "model": str(model_dir.absolute())}, indent=2))
    return ckpt, out
