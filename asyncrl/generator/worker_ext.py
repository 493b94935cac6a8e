"""Code that runs inside each vLLM worker process (mixed into the worker via `worker_extension_cls`).

Owns: the generator's own worker-side call (and, on import, the worker's watch on the replica
that owns it, owner_watch.py): while generation is paused, how many tokens each
sequence has sampled (the replica's version ledger on engines that do not stamp versions
themselves). The weight-update half of the worker (staging, verification, the direct copy or
`reload_weights`, collective groups) is weightsync's `WeightsyncWorkerExtension`, inherited here.

Must never: change the weight version label (the replica sets it in the engine core after the
load, while generation is paused).
"""

from __future__ import annotations

from asyncrl.generator.owner_watch import watch_owner
from asyncrl.generator.vllm_engine import worker_sampled_token_counts
from asyncrl.weightsync.vllm_worker import WeightsyncWorkerExtension

# Imported in each vLLM worker process as it starts: it ends with the replica that started it.
watch_owner()


class WeightUpdateExtension(WeightsyncWorkerExtension):
    """Methods are prefixed `asyncrl_` so they never clash with the worker's own attributes."""

    def asyncrl_sampled_token_counts(self) -> dict[str, int] | None:
        """Output tokens sampled so far per sequence this worker holds (engine-internal ids).

        Read while generation is paused, so no step is changing them; with async scheduling a
        token still being resolved is a placeholder here and is counted. None when the model
        runner keeps no per-request state (the replica then falls back to frontend counts).
        """
        return worker_sampled_token_counts(self)
