"""torch.profiler around a rank's training steps, driven by `ProfilerConfig`, and its Python heap's growth.

Owns: deciding whether this rank profiles (`use_profile` or `heap`, and rank in `profile_ranks`), starting
when the step counter reaches `step_start`, stopping after `step_end`, and writing per rank and step range
one Chrome trace ({save_path}/rank{rank}_steps{step_start}-{step_end}.json, `use_profile`) and the lines
whose Python allocations grew most over the range, with the RSS (..._heap_steps{start}-{end}.txt, `heap`).
Steps are counted per call of `step()` (1-based: the first training step is step 1).

Must never: profile a step outside the range, or raise into training when a trace cannot be
written (the error is kept in `last_error` and the step goes on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncrl.config import ProfilerConfig

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, cfg: ProfilerConfig | None, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.enabled = bool(cfg and (cfg.use_profile or cfg.heap) and rank in cfg.profile_ranks)
        self.current_step = 0
        self._prof: torch.profiler.profile | None = None
        self._heap: tuple[tracemalloc.Snapshot, float, bool] | None = None  # (at step_start, its RSS MB, started here)
        self.trace_path: Path | None = None
        self.heap_path: Path | None = None
        self.last_error: str | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step; profiles it when it lies in [step_start, step_end]."""
        self.current_step += 1
        if not self.enabled:
            yield
            return
        cfg = self.cfg
        if self.current_step == cfg.step_start and cfg.heap and self._heap is None:
            started = not tracemalloc.is_tracing()
            if started:
                tracemalloc.start(8)
            self._heap = (tracemalloc.take_snapshot(), _rss_mb(), started)
        if self.current_step == cfg.step_start and cfg.use_profile and self._prof is None:
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
            if self._heap is not None and self.current_step >= cfg.step_end:
                self._finish_heap()

    def _finish_heap(self, top: int = 40) -> None:
        (before, rss_before, started), self._heap = self._heap, None  # type: ignore[misc]
        try:
            after = tracemalloc.take_snapshot()
            if started:
                tracemalloc.stop()
            ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
            diff = after.filter_traces(ignore).compare_to(before.filter_traces(ignore), "lineno")
            steps = self.cfg.step_end - self.cfg.step_start + 1
            grown = sum(d.size_diff for d in diff)
            lines = [f"rank {self.rank}, steps {self.cfg.step_start}-{self.cfg.step_end} ({steps}): Python heap "
                     f"{grown / 2**20:+.2f} MiB ({grown / steps / 2**10:+.1f} KiB a step), RSS {rss_before:.1f} -> "
                     f"{_rss_mb():.1f} MB", "size_diff_kib count_diff where"]
            lines += [f"{d.size_diff / 2**10:+.1f} {d.count_diff:+d} {d.traceback}" for d in diff[:top]]
            out = Path(self.cfg.save_path)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{self.rank}_heap_steps{self.cfg.step_start}-{self.cfg.step_end}.txt"
            path.write_text("\n".join(lines) + "\n")
            self.heap_path = path
        except Exception as err:  # a profiler problem must not stop training
            self.last_error = repr(err)
            log.warning("heap profile for rank %d failed: %r", self.rank, err)

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


def _rss_mb() -> float:
    """This process's resident set now, MB (/proc; its peak so far where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
