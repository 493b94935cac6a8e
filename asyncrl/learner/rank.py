"""One learner rank as a Ray actor: process setup around exactly one role object.

Owns: the process-level lifecycle of a rank (CPU compat on CPU-only hosts, `init_distributed`
with rank 0's address, `init_model_parallel`, building the one role named at construction from a
role-name -> class map), forwarding the role's public methods, packing exported HF tensors into
weightsync buckets, distributed checkpoints (model + optimizer + LR schedule + RNG) and the
profiler around training steps.

Must never: hold role logic (the role classes do), decide data placement (the group does), or
build more than one role per process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, ProfilerConfig
from asyncrl.interfaces import ROLE_TRAINING_VERBS, ROLE_VERBS, RoleAPI, verb_name
from asyncrl.types import HostCopies, SenderAddress, WeightExport

# The actor's calls run one at a time, in order, except `take_host_copies`: it waits for the device-to-host copies of
# the last push (the rank's own threads make them) in a concurrency group of its own, so that the calls behind it
# (the hybrid switch's release of the params, the next step's training) never wait for those copies.
CONCURRENCY_GROUPS = {"host_copies": 1}


def actor_class(cls: type | None = None) -> Any:
    """`cls` (default `LearnerRank`) as the Ray actor class `LearnerGroup` starts: with `CONCURRENCY_GROUPS`."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls or LearnerRank)


class LearnerRank:
    """Made a Ray actor by `actor_class` (`LearnerGroup`); plain class so it is testable without Ray."""

    def __init__(
        self, rank: int, world_size: int, role: str, model_cfg: ModelConfig, learner_cfg: LearnerConfig,
        algorithm_cfg: AlgorithmConfig, profiler_cfg: ProfilerConfig | None = None,
        role_classes: dict[str, type] | None = None,
    ) -> None:
        if role_classes is None:
            from asyncrl.learner.roles import ROLE_CLASSES

            role_classes = ROLE_CLASSES
        if role not in role_classes:
            raise ValueError(f"unknown learner role {role!r}; known: {sorted(role_classes)}")
        self.rank, self.world_size, self.role_name = rank, world_size, role
        self.role_cls = role_classes[role]
        self.model_cfg, self.learner_cfg, self.algorithm_cfg = model_cfg, learner_cfg, algorithm_cfg
        self.profiler_cfg = profiler_cfg
        self.role: Any = None
        self.layout: Any = None
        self.coords: Any = None
        self._sender: Any = None  # sending ranks: their end of weight pushes (weightsync/link.py)
        from asyncrl.learner.memory import HostMemoryTrim

        self.host_trim = HostMemoryTrim()  # freed host memory given back as the resident set creeps (memory.py)
        self._store: Any = None  # rank 0: the group's rendezvous store, bound before setup

    # ------------------------------------------------------------------ setup

    def master_address(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """Rank 0: host the group's rendezvous store now, on a port the OS picks and this process
        keeps bound (a probed free port could be taken by another process before the store binds
        it); returns where the other ranks join it."""
        import datetime

        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        if self._store is None:
            self._store = dist.TCPStore(host, 0, self.world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                                        wait_for_workers=False)
        return host, int(self._store.port)

    def _rendezvous(self, master_addr: str, master_port: int, timeout_s: float) -> Any:
        """Rank 0's own store, or a client of it: every rank passes the same (unprefixed) store."""
        import datetime

        import torch.distributed as dist

        if self.rank == 0:
            if self._store is None:
                raise RuntimeError("rank 0: master_address() must run before setup() (it binds the rendezvous store)")
            return self._store
        return dist.TCPStore(master_addr, int(master_port), self.world_size, False, timeout=datetime.timedelta(seconds=timeout_s))

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 600.0) -> dict[str, Any]:
        import torch
        from transformers import AutoConfig

        from asyncrl.learner.compat import install_cpu_compat
        from asyncrl.learner.parallel import init_distributed, init_model_parallel, rank_coords
        from asyncrl.learner.profiler import StepProfiler
        from asyncrl.learner.roles.base import RoleContext

        threads = max(1, int(self.learner_cfg.num_cpus_per_rank))
        torch.set_num_threads(threads)  # ranks share cores: don't let each grab them all
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        self._compat = install_cpu_compat()
        torch.manual_seed(self.learner_cfg.seed)
        with self._thread():
            init_distributed(self.rank, self.world_size, master_addr, master_port, timeout_s=timeout_s,
                             store=self._rendezvous(master_addr, master_port, timeout_s))
            hf = AutoConfig.from_pretrained(self.model_cfg.path, trust_remote_code=self.model_cfg.trust_remote_code)
            self.layout = init_model_parallel(self.learner_cfg, hf)
            self.coords = rank_coords(self.rank, self.layout)
            ctx = RoleContext(self.model_cfg, self.learner_cfg, self.algorithm_cfg, hf, self.layout, self.rank)
            self.role = self.role_cls(ctx)
        self.profiler = StepProfiler(self.profiler_cfg, self.rank)
        return {"rank": self.rank, "coords": self.coords.__dict__, "cpu_compat": self._compat.active}

    def _thread(self):
        # Torch function modes are per thread; Ray may run calls on another thread than setup's.
        from asyncrl.learner.compat import cpu_compat_thread

        return cpu_compat_thread()

    def _ready(self) -> None:
        if self.role is None:
            raise RuntimeError(f"rank {self.rank}: setup() has not run")

    # ------------------------------------------------------------------ role calls

    def call(self, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the role verb `verb` (by reference: `RoleAPI.update_actor`; one of ROLE_VERBS) on this
        rank's role; the answer of non-collecting ranks is None (nothing shipped). A verb the role
        does not implement is refused with a clear error."""
        self._ready()
        method = verb_name(RoleAPI, verb, ROLE_VERBS)
        if not hasattr(self.role, method):
            raise AttributeError(f"role {self.role_name!r} has no verb {method!r}")
        from asyncrl.learner.memory import device_memory, is_out_of_memory, out_of_memory_error

        try:
            with self._thread():
                if verb in ROLE_TRAINING_VERBS:
                    with self.profiler.step():
                        out = getattr(self.role, method)(*args, **kwargs)
                        _finish_device_work()
                    self.host_trim.after_step()
                    return out
                return getattr(self.role, method)(*args, **kwargs)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            samples = args[0] if args and isinstance(args[0], list) else []
            lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
            raise out_of_memory_error(method, self.rank, lengths, self.learner_cfg, *device_memory()) from err

    # ------------------------------------------------------------------ weight pushes (weightsync/link.py)

    def _is_sender(self) -> bool:
        """TP/CP/DP rank 0 of each PP stage (its sender id is its PP stage)."""
        c = self.coords
        return c.tp == 0 and c.cp == 0 and c.dp == 0

    def _endpoint(self) -> Any:
        if self._sender is None:
            from asyncrl.weightsync.link import SenderEndpoint

            self._sender = SenderEndpoint()
        return self._sender

    def _drain(self, tensors: Any) -> None:
        for _ in tensors:  # every rank drives the export to its end: its TP/EP gathers are collective
            pass

    def set_push_plan(self, plan: bytes | None, host_copies: bool = False) -> str | None:
        """Every rank keeps the push plan (None: HF tensors): its sending ranks pack later pushes in the engines'
        layout of it. `host_copies` (ipc or NCCL from GPUs): a sending rank allocates the pinned buffers of its
        pushes' host copies now (link.py)."""
        self._ready()
        held = self._endpoint().set_plan(plan)
        if host_copies and self._is_sender():
            self._endpoint().pin_host_copies(self.coords.pp)
        return held

    def export_weights(self, bucket_mb: float, transport: str = "object_store", verify: str = "full",
                       layout: str = "hf", timeout_s: float = 600.0, gate: str = "") -> WeightExport | None:
        """One version out of this rank (sending ranks; the others drive their part of the export, whose TP/EP
        gathers are collective, and answer None). `layout`: "engine", the push plan's (`set_push_plan`; HF
        tensors where none is set), or "hf", the HF tensors as exported. Over nccl / gloo / ipc (`transport`):
        packed on the device and broadcast to the engine workers over this rank's group, whose host copies
        (rollbacks, late joiners) `take_host_copies` collects, within `timeout_s`; `gate`: the push's
        gate token (gloo / NCCL: nothing goes out until every receiver is ready; collective.py). Over shm /
        object_store: packed into host buckets of it, a shared file or an object each. Every bucket is hashed
        in `verify` mode as it is packed."""
        from asyncrl.weightsync.shm import pack_into_transport
        from asyncrl.weightsync.transport import BACKENDS

        self._ready()
        with self._thread(), self._held(("params",)):
            tensors = self.role.export_hf_tensors()
            if not self._is_sender():
                self._drain(tensors)
                return None
            plan, sender = (self._endpoint().plan if layout == "engine" else None), self.coords.pp
            if transport in BACKENDS:
                return self._endpoint().send_version(tensors, bucket_mb, verify, timeout_s, sender, plan, gate, transport)
            return pack_into_transport(tensors, bucket_mb, transport, verify, plan, sender)

    def join_collective(self, specs: list[dict[str, Any]] | None = None) -> SenderAddress | None:
        """Sending ranks (TP/CP/DP rank 0 of each PP stage): leave any earlier weight broadcast group and join (as
        group rank 0) this rank's group of `specs`; None: join nothing, and hold a port where the next group this
        rank hosts can rendezvous. Answers that address
        (port 0 after a join) and the group held now if it can still carry a push. Others: None."""
        import ray

        self._ready()
        if specs is not None:
            self._leave_collective()
        if not self._is_sender():
            return None
        host, sender = ray.util.get_node_ip_address(), self.coords.pp
        if specs is None:
            return self._endpoint().address(host, sender)
        with self._thread():
            return SenderAddress(sender, host, 0, self._endpoint().join(specs, sender, self.rank))

    def _leave_collective(self) -> None:
        if self._sender is not None:
            self._sender.leave()

    @ray.method(concurrency_group="host_copies")
    def take_host_copies(self, timeout_s: float) -> HostCopies | None:
        """The host copies (ObjectRefs, in bucket order) of this rank's last broadcast, once all
        are in the object store (non-sending ranks: None). Each push's copies are taken once. Runs
        beside the rank's other calls (`CONCURRENCY_GROUPS`): it only waits for the copies' threads."""
        if not self._is_sender():
            return None
        return self._endpoint().take_host_copies(timeout_s, self.coords.pp)

    # ------------------------------------------------------------------ device residency (hybrid)

    def _held(self, parts: tuple[str, ...] | None = None):
        """The role's offloaded state on the device for one call (params only for an export:
        an offloaded parameter's storage is empty, so an export or checkpoint must bring it back)."""
        offloader = getattr(self.role, "offloader", None)
        if offloader is None:
            return contextlib.nullcontext()
        return offloader.onloaded(parts) if parts else offloader.onloaded()

    def hold_device(self, parts: list[str] | None = None) -> dict[str, Any]:
        """Keep `parts` (default all) on the device until `release_device` (the hybrid learner phase)."""
        return self._residency("hold", parts)

    def release_device(self, parts: list[str] | None = None, wake_need: tuple[float, int] | None = None) -> dict[str, Any]:
        """Drop the hold on `parts`. `wake_need` (fraction of the device's memory, bytes): first decide
        whether this rank's flagged state may stay on the device, i.e. whether that much stays free
        beside it for the engines' wake (hybrid `learner_offload: when_short`), plus one version's
        bytes for the push's staging (the ipc sender packs the whole version into one arena)."""
        return self._residency("release", parts, wake_need)

    def _residency(self, op: str, parts: list[str] | None, wake_need: tuple[float, int] | None = None) -> dict[str, Any]:
        from asyncrl.learner.offload import PARTS, device_free_bytes, device_total_bytes

        self._ready()
        offloader = getattr(self.role, "offloader", None)
        report: dict[str, float] = {}
        if offloader is not None:
            with self._thread():
                decided = {}
                if wake_need is not None:
                    fraction, extra = wake_need
                    offloader.decide_residency(int(fraction * device_total_bytes()) + int(extra) + offloader.param_bytes)
                    decided = dict(offloader.last_report)
                report = {**decided, **getattr(offloader, op)(tuple(parts) if parts else PARTS)}
        return {"rank": self.rank, "report": report, "device_free_bytes": device_free_bytes(),
                "holds": offloader.holds() if offloader is not None else {}}

    # ------------------------------------------------------------------ checkpoints / state

    def _checkpoint_parts(self) -> tuple[list[Any], Any, Any]:
        # checkpoint.py unwraps Megatron DDP to the bare models (same parameter objects).
        return self.role.checkpoint_parts()

    def save_checkpoint(self, path: str) -> str:
        from asyncrl.learner.checkpoint import save_checkpoint

        self._ready()
        chunks, optimizer, schedule = self._checkpoint_parts()
        extra = {"role": self.role_name, **({"lora": lora} if (lora := self._lora()) else {})}
        with self._thread(), self._held():
            if optimizer is not None:
                # Before any step Adam has no state, and Megatron's load of a checkpoint without it fails on the
                # missing keys: a fresh optimizer's state is made first (no-op once it exists; changes no weight).
                self.role.optim.warm_up()
            out = save_checkpoint(path, chunks, optimizer, extra=extra, scheduler=schedule)
        return str(out)

    def _lora(self) -> dict[str, Any] | None:
        """learner.lora's settings where this rank's role trains adapters (the actor), as its checkpoints record them."""
        lora = self.learner_cfg.lora
        return lora.model_dump(mode="json") if lora is not None and self.role_name == "actor" else None

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from asyncrl.learner.checkpoint import load_checkpoint, saved_extra

        self._ready()
        saved = saved_extra(path).get("lora")
        if (saved is None) != (self._lora() is None):  # Megatron would load the base weights alone, or fail on keys
            raise ValueError(f"checkpoint {path} was written {'with learner.lora ' + str(saved) if saved else 'without LoRA'}"
                             f", and this learner {'trains LoRA adapters' if saved is None else 'has no learner.lora'}: "
                             "resume with the run's own learner.lora")
        chunks, optimizer, schedule = self._checkpoint_parts()
        with self._thread(), self._held():
            return load_checkpoint(path, chunks, optimizer, scheduler=schedule)

    def state(self) -> dict[str, Any]:
        import ray

        return {
            "rank": self.rank,
            "role": self.role_name,
            "ready": self.role is not None,
            "coords": self.coords.__dict__ if self.coords else None,
            "node_id": ray.get_runtime_context().get_node_id(),
            "metrics": self.role.state() if self.role is not None else {},
            "trace": str(self.profiler.trace_path) if getattr(self, "profiler", None) and self.profiler.trace_path else None,
        }

    def teardown(self) -> None:
        from asyncrl.learner.parallel import destroy_model_parallel

        self._leave_collective()
        if self._sender is not None:
            self._sender.drop_reserved()
        if self.role is not None:
            self.role = None
            with self._thread():
                destroy_model_parallel()


def _finish_device_work() -> None:
    """Wait for the training step's own device work (on CUDA: the current stream, where the optimizer's
    update and the fp32 -> bf16 parameter copies are queued after the host has moved on) before the step
    returns: the step's time then holds its optimizer, and a push that follows starts from final weights
    instead of waiting for them inside its own time (its first bucket would land behind the queued Adam
    update). Not the
    whole device: a previous push's host copies run on side streams beside the next step."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()

