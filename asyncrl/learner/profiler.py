"""torch.profiler around a rank's training steps, driven by `ProfilerConfig`.

Owns: deciding whether this rank profiles (`use_profile` and rank in `profile_ranks`), starting
the profiler when the step counter reaches `step_start`, stopping it after `step_end`, and
writing one Chrome trace per rank and step range:
    {save_path}/rank{rank}_steps{step_start}-{step_end}.json
Steps are counted per call of `step()` (1-based: the first training step is step 1).

Must never: profile a step outside the range, or raise into training when a trace cannot be
written (the error is kept in `last_error` and the step goes on).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncrl.config import ProfilerConfig

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, cfg: ProfilerConfig | None, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.enabled = bool(cfg and cfg.use_profile and rank in cfg.profile_ranks)
        self.current_step = 0
        self._prof: torch.profiler.profile | None = None
        self.trace_path: Path | None = None
        self.last_error: str | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step; profiles it when it lies in [step_start, step_end]."""
        self.current_step += 1
        if not self.enabled:
            yield
            return
        cfg = self.cfg
        if self.current_step == cfg.step_start and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()
        try:
            with torch.profiler.record_function(f"asyncrl/step_{self.current_step}"):
                yield
        finally:
            if self._prof is not None and self.current_step >= cfg.step_end:
                self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.stop()
            out = Path(self.cfg.save_path)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{self.rank}_steps{self.cfg.step_start}-{self.cfg.step_end}.json"
            prof.export_chrome_trace(str(path))
            self.trace_path = path
        except Exception as err:  # a profiler problem must not stop training
            self.last_error = repr(err)
            log.warning("profiler trace for rank %d failed: %r", self.rank, err)
