"""The push's wire, seen from the two ends: one sender loop and one receiver loop per push,
whatever the group's backend.

Owns: picking the loop by the group's backend: the broadcast stream (stream.py, gloo and NCCL)
or the handle stream (ipc.py, sender and receivers on one device). Callers (sender.py on the
learner's side, vllm_worker.py on the engine's) import from here and never from either loop.

Must never: hold protocol of its own; each loop owns its wire format and failure handling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from asyncrl.weightsync.bucket import Bucket
from asyncrl.weightsync.collective import CollectiveGroup
from asyncrl.weightsync.ipc import ipc_receive_stream, ipc_refuse, ipc_send_stream
from asyncrl.weightsync.stream import SendResult, broadcast_send_stream
from asyncrl.weightsync.stream_receive import broadcast_receive_stream


def send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                verify: str, timeout_s: float, keep: Callable[[Bucket], Any] | None = None,
                plan: Any = None, sender: int = 0, arena: str = "auto", gate: str = "") -> SendResult:
    """Send one version over `group`: bucket (in the engines' layout with a `plan`), hash in the
    `verify` mode, send, and hand each bucket's host copy to `keep` off the critical path. `arena`
    (gloo / NCCL, a whole planned version): where the sender packs it (stream.broadcast_send_stream);
    an ipc sender packs into its own ring. `gate` (gloo / NCCL): the push's gate token; ipc needs none
    (a receiver that refuses tells its sender through the store)."""
    if group.spec.backend == "ipc":
        return ipc_send_stream(group, named_tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=keep, plan=plan,
                               sender=sender)
    return broadcast_send_stream(group, named_tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=keep,
                                 plan=plan, sender=sender, arena=arena, gate=gate)


def receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    """Receive one version over `group`: yields each bucket with the sender's digests of it, until
    the sender's end; raises `SenderAborted` when the sender aborted."""
    loop = ipc_receive_stream if group.spec.backend == "ipc" else broadcast_receive_stream
    return loop(group, deadline)


def refuse_push(group: CollectiveGroup, why: str, gate: str = "") -> None:
    """This receiver refuses the coming push before reading any of it: ipc tells the sender through
    the store; a broadcast group closes the push's gate (`gate`), so every member leaves before the wire."""
    if group.spec.backend == "ipc":
        ipc_refuse(group, why)
    elif gate:
        group.close_gate(gate, why)
