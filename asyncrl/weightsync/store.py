"""The `WeightStore`: the latest live version's weights, for replicas that start later.

Owns: a tiny named Ray actor (`WeightStore`) remembering the latest committed (version, buckets, fingerprint, plan), so
a replica that starts late (autoscaling, a restart) loads the live weights before it reports healthy;
`weight_store_hook`, the publisher's `on_live` hook that sends it each live version without the training loop waiting;
and `load_hf_tensors` (a checkpoint directory's tensors). Buckets are kept packed (Ray moves their numpy buffers out of
band; a list of torch tensors is slow to pickle) and an engine-layout version comes with its push plan, so a replica
whose engines share that layout applies it directly and any other rebuilds the Hugging Face tensors from it.
Must never: decide when a version is live (the publisher calls `publish` only after every live replica committed it).
Details: docs/design/weightsync.md, "The WeightStore".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.weightsync.fingerprint import combine_digests, fingerprint_mode

STORE_NAME = "asyncrl_weight_store"  # the named actor late replicas load from
STORE_NAMESPACE = "asyncrl"


def load_hf_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def buckets_fingerprint(buckets: list[Any], mode: str) -> str:
    """The fingerprint of packed buckets (HF or engine layout), as a push computes it."""
    from asyncrl.weightsync.bucket import digest_key_prefix
    from asyncrl.weightsync.fingerprint import bucket_digests

    digests: dict[str, bytes] = {}
    for bucket in buckets:
        digests.update(bucket_digests(bucket, mode, digest_key_prefix(bucket)))  # type: ignore[arg-type]
    return combine_digests(digests, mode)  # type: ignore[arg-type]


class WeightStore:
    """Holds the latest committed (version, buckets, fingerprint, plan). Run as a named Ray actor.

    Interface (kept small on purpose):
      publish(version, buckets | named_tensors, fingerprint, plan=None) -> None   # version must increase; fingerprint checked
      latest() -> (version, buckets | None, fingerprint)   # (0, None, "") before any publish
      plan() -> the push plan of the latest buckets (None: Hugging Face layout)
      set_push_plan(plan) / push_plan() -> the plan pushes use now (formed with the replicas running
          then): a replica that starts before the first push has no stored version to load, but
          takes this plan, so that push does not find it without one
      version() -> int
    """

    BUCKET_MB = 256.0

    def __init__(self) -> None:
        self._version = 0
        self._buckets: list[Any] | None = None
        self._fingerprint = ""
        self._plan: Any = None
        self._push_plan: Any = None
        self._refs: list[Any] = []  # the latest version's ObjectRefs, when it came as such

    def publish(self, version: int, weights: Any, fingerprint: str, plan: Any = None) -> None:
        from asyncrl.weightsync.bucket import Bucket, iter_buckets

        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version={version!r} must be an int greater than the stored {self._version}")
        weights = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        refs = [w for w in weights if _is_ref(w)]
        if refs:  # a version's ObjectRefs (push.py, `weight_store_hook`, below): read here, where they lie (mapped,
            import ray  # not copied, on the same node); the refs are kept with them, which keeps the objects

            got = iter(ray.get(refs))
            weights = [next(got) if _is_ref(w) else w for w in weights]
        if all(isinstance(b, Bucket) for b in weights):
            buckets = weights
        else:
            buckets = list(iter_buckets(weights, self.BUCKET_MB))  # checks names, brings tensors to CPU
        actual = buckets_fingerprint(buckets, fingerprint_mode(fingerprint))
        if actual != fingerprint:
            raise ValueError(f"fingerprint mismatch for version {version}: given {fingerprint[:24]}, tensors hash to {actual[:24]}")
        if refs and all(getattr(b, "rank", None) is None for b in buckets):
            plan = None  # (sent as refs, unseen by the hook) Hugging Face buckets: no engine layout to apply them in
        self._version, self._buckets, self._fingerprint, self._plan = version, buckets, fingerprint, plan
        self._refs = refs

    def latest(self) -> tuple[int, list[Any] | None, str]:
        return self._version, self._buckets, self._fingerprint

    def plan(self) -> Any:
        return self._plan

    def set_push_plan(self, plan: Any) -> None:
        self._push_plan = plan

    def push_plan(self) -> Any:
        return self._push_plan

    def version(self) -> int:
        return self._version


def _is_ref(value: Any) -> bool:
    try:
        import ray
    except ImportError:
        return False
    return isinstance(value, ray.ObjectRef)


def weight_store_hook(store: Any, plan_of: Callable[[str], Any] | None = None) -> Callable[[int, str, list[Any]], Any]:
    """`on_live` hook publishing a live version to the `WeightStore` actor (above), with the push
    plan (`plan_of(version)`, read as the version goes live) for engine-layout buckets (the store tells those sent as ObjectRefs).

    The store's copy only serves replicas that start later, so nothing waits for it: the hook
    returns at once. One store update is in flight at a time (sent from a thread: sending buckets
    rather than ObjectRefs copies them into the object store); a version that goes live meanwhile
    waits for it, and a newer one replaces it there (the store only ever serves the latest, and a
    late joiner that loads an older one is brought up by the next push). A failed update surfaces
    as the next call's error, which the publisher reports as a warning."""
    state: dict[str, Any] = {"task": None, "next": None, "error": None}

    async def send(args: tuple[int, str, list[Any], Any] | None) -> None:
        loop = asyncio.get_running_loop()
        while args is not None:
            version, fingerprint, buckets, plan = args
            try:
                ref = await loop.run_in_executor(None, lambda: store.publish.remote(version, buckets, fingerprint, plan))
                await ref
            except Exception as exc:  # noqa: BLE001 - the next call raises it
                state["error"] = exc
            args, state["next"] = state["next"], None

    async def publish(version: int, fingerprint: str, buckets: list[Any]) -> None:
        hf = all(getattr(b, "rank", 0) is None for b in buckets)  # (an ObjectRef has no rank: the store tells)
        args = (version, fingerprint, buckets, plan_of(version) if plan_of is not None and not hf else None)  # as it went live
        task = state["task"]
        if task is not None and not task.done():
            state["next"] = args  # (replacing one that waited)
        else:
            state["task"] = asyncio.ensure_future(send(args))
        error, state["error"] = state["error"], None
        if error is not None:
            raise error

    return publish
