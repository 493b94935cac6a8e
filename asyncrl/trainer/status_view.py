"""`asyncrl status [URL]`: the trainer's `/train/status` snapshot as a few terminal lines.

Owns: the text form of a status snapshot (`Trainer.status()` in trainer/loop.py) and
fetching it over HTTP. Must never: change the snapshot's meaning (every number shown is one the
snapshot holds) or need more than the standard library (it runs on any machine that can reach the API).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
_DROPPED = ("dropped_stale", "dropped_invalid", "dropped_filtered", "dropped_failed")


class StatusUnavailable(RuntimeError):
    """The API could not be reached or gave no training status; the message says which and why."""


def fetch_status(url: str = DEFAULT_URL, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET `url`/train/status (`url` may also be that route itself)."""
    base = url.rstrip("/")
    target = base if base.endswith("/train/status") else base + "/train/status"
    if "://" not in target:
        target = "http://" + target
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("detail", detail)
        except (ValueError, AttributeError):
            pass
        raise StatusUnavailable(f"{target}: HTTP {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise StatusUnavailable(f"{target}: cannot connect ({reason}); is the app running (`make serve`)?") from None
    try:
        status = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{target}: the answer is not JSON: {body[:200]!r}") from None
    if not isinstance(status, dict) or "state" not in status:
        raise StatusUnavailable(f"{target}: not a training status: {str(status)[:200]}")
    return status


def _num(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_status(status: dict[str, Any]) -> str:
    """The snapshot as lines: state and progress, reward and accuracy, buffer accounting, timing."""
    m = status.get("metrics") or {}
    total = status.get("total_steps")
    step = status.get("step")
    lines = [f"state        {status.get('state')}   step {step}/{total}   policy version {status.get('policy_version')}"
             f"   elapsed {_duration(status.get('elapsed_s'))}"]
    history = status.get("eval_history") or []
    acc = f"{_num(status.get('eval_accuracy'))} (at step {history[-1][0]})" if history else "-"
    if len(history) > 1:
        acc += f", first {_num(history[0][1])} at step {history[0][0]}"
    lines.append(f"reward       {_num(status.get('reward_mean'))}   held-out accuracy {acc}")
    b = {k.removeprefix("buffer/"): v for k, v in (status.get("buffer") or {}).items()}
    if b:
        dropped = "  ".join(f"{k} {b[k]:g}" for k in _DROPPED if k in b)
        lines.append(f"buffer       generated {b.get('generated', 0):g} = trained {b.get('trained', 0):g} + waiting "
                     f"{b.get('waiting', 0):g} + dropped ({dropped})   running {b.get('running', 0):g}")
        parts = [b.get(k, 0) for k in ("trained", "waiting", *_DROPPED)]
        if "generated" in b and not math.isclose(b["generated"], sum(parts)):
            lines.append(f"             accounting does not add up: {b['generated']:g} != {sum(parts):g}")
        if "staleness_mean" in b:
            lines.append(f"staleness    mean {_num(b['staleness_mean'], '.2f')}   max {_num(b.get('staleness_max'), 'g')}")
    timing = [(label, m.get(key)) for label, key in (("train", "time/train_s"), ("sync", "time/sync_s"))]
    if any(v is not None for _, v in timing) or "rollout/tokens_per_s" in m:
        lines.append("last step    " + "   ".join(f"{label} {_num(v, '.2f')} s" for label, v in timing)
                     + f"   rollout {_num(m.get('rollout/tokens_per_s'), '.0f')} tokens/s")
    if status.get("learner_restarts"):
        lines.append(f"restarts     {status['learner_restarts']} learner restart(s)")
    for w in status.get("waiting_for") or []:  # what Ray has not placed yet, and why
        lines.append(f"waiting      {w.get('pool')}: {w.get('asks')} for {_duration(w.get('for_s'))}: {w.get('why')}")
    if status.get("error"):
        lines.append(f"error        {status['error']}")
    return "\n".join(lines)
