"""Logging for the training loop: `asyncrl` loggers at INFO, one progress line per step.

Owns: the progress line format. Must never: log inside hot loops (one line per learner step).
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.config import LoggingConfig
from asyncrl.log_setup import asyncrl_logs_at_info


def configure_logging(cfg: LoggingConfig) -> None:  # noqa: ARG001 - the section keeps the call site's shape
    asyncrl_logs_at_info()


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def progress_line(step: int, total: int, metrics: dict[str, Any], width: int = 20) -> str:
    """`[#####-----] 12/200 reward 0.45 acc 0.52 stale 0.8 tok/s 1.2k` (what the bar shows)."""
    done = int(width * step / max(total, 1))
    tokens_per_s = metrics.get("rollout/tokens_per_s")
    return (
        f"[{'#' * done}{'-' * (width - done)}] {step}/{total}"
        f" reward {_fmt(metrics.get('train/reward_mean'), '.3f')}"
        f" acc {_fmt(metrics.get('eval/accuracy'), '.3f')}"
        f" stale {_fmt(metrics.get('buffer/staleness_mean'), '.2f')}"
        f" tok/s {_fmt(tokens_per_s, '.0f')}"
    )
