"""Bucketing: pack -> unpack is bit-exact, buckets respect their size, the packer is lazy."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.weightsync.bucket import ALIGN, Bucket, iter_buckets, unpack_bucket
from tests.weightsync.fakes import iter_unpacked

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Random raw bits, so every bit pattern (NaN payloads, -0.0, subnormals) must survive.
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 17), min_size=0, max_size=3).map(tuple),
        st.integers(0, 2**31 - 1),
    ),
    min_size=0,
    max_size=12,
)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(specs=tensor_specs, bucket_kb=st.sampled_from([0.05, 0.5, 4, 1024]))
def test_pack_unpack_is_bit_exact(specs, bucket_kb):
    named = [(f"t{i}", _random_tensor(d, s, seed)) for i, (d, s, seed) in enumerate(specs)]
    buckets = list(iter_buckets(iter(named), bucket_kb / 1024))
    out = list(iter_unpacked(buckets))
    assert [n for n, _ in out] == [n for n, _ in named]  # stream order kept
    for (_, a), (_, b) in zip(named, out):
        assert _bitwise_equal(a, b), (a.dtype, a.shape)
    cap = int(bucket_kb / 1024 * (1 << 20))
    for b in buckets:
        # Over the cap only when a single tensor is larger than a bucket on its own.
        assert b.payload_bytes <= cap or len(b) == 1
        assert all(m.offset % ALIGN == 0 for m in b.metas)


def test_oversized_tensor_goes_alone_and_order_is_kept():
    named = [("a", torch.zeros(10)), ("big", torch.ones(1000)), ("b", torch.zeros(10)), ("c", torch.zeros(10))]
    buckets = list(iter_buckets(named, bucket_mb=1000 / (1 << 20)))  # 1000-byte buckets
    assert [b.names for b in buckets] == [["a"], ["big"], ["b", "c"]]


def test_unpack_returns_views_not_copies():
    bucket = next(iter_buckets([("w", torch.arange(8, dtype=torch.float32))], bucket_mb=1))
    (name, view), = unpack_bucket(bucket)
    bucket.buffer[:4] = np.frombuffer(np.float32(42.0).tobytes(), dtype=np.uint8)
    assert view[0].item() == 42.0  # the view sees writes to the buffer: no copy was made


def test_unpack_works_on_a_read_only_buffer_like_the_object_store():
    t = torch.randn(3, 5).to(torch.bfloat16)
    bucket = next(iter_buckets([("x", t)], bucket_mb=1))
    restored = pickle.loads(pickle.dumps(bucket, protocol=5))
    restored.buffer.setflags(write=False)
    (_, got), = unpack_bucket(restored)
    assert _bitwise_equal(got, t)


def test_packer_is_lazy():
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(256)  # 1 KiB each

    it = iter_buckets(stream(), bucket_mb=2 / 1024)  # two tensors per bucket
    first = next(it)
    assert first.names == ["t0", "t1"]
    assert pulled == [0, 1, 2]  # one tensor past the first bucket, not the whole model


def test_duplicate_names_and_bad_values_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1))
    with pytest.raises(TypeError):
        list(iter_buckets([("a", [1, 2])], 1))


def test_corrupt_metadata_is_detected():
    bucket = next(iter_buckets([("a", torch.zeros(4))], 1))
    bad = Bucket(buffer=bucket.buffer, metas=[bucket.metas[0].__class__("a", "float32", (400,), 0, 1600)])
    with pytest.raises(ValueError, match="does not fit"):
        unpack_bucket(bad)


@pytest.mark.parametrize("mode", ["full", "checksum", "off"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_buckets_sharing_one_buffer_hash_in_one_pass_to_the_same_digests(mode, device):
    """An ipc arena: every bucket a view of one buffer. `buckets_digests_lazy` reads them in one
    pass over that buffer and must give each tensor the digest `bucket_digests` gives it alone,
    with each bucket's key prefix; buckets in separate buffers take the per-bucket path, same digests."""
    from asyncrl.weightsync.fingerprint import PendingDigests, bucket_digests, buckets_digests_lazy

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(3)
    tensors = [(f"t{i}", torch.randn(n, generator=g).to(dt)) for i, (n, dt) in
               enumerate([(5000, torch.float32), (77, torch.bfloat16), (40000, torch.float32), (3, torch.float16)])]
    loose = list(iter_buckets(iter(tensors), 0.05))  # several buckets, each its own buffer
    assert len(loose) > 1
    arena = torch.zeros(sum(-(-b.nbytes // 256) * 256 for b in loose) + 512, dtype=torch.uint8, device=device)
    shared, at = [], 256  # the first bucket not at the buffer's start
    for b in loose:
        view = arena[at : at + b.nbytes]
        view.copy_(torch.as_tensor(np.asarray(b.buffer)).view(torch.uint8).reshape(-1))
        shared.append((Bucket(buffer=view, metas=list(b.metas), rank=None), f"p{at}/"))
        at += -(-b.nbytes // 256) * 256
    want = {}
    for b, prefix in shared:
        want.update(bucket_digests(b, mode, prefix))
    assert buckets_digests_lazy(shared, mode)() == want
    apart = [(Bucket(buffer=b.buffer.clone(), metas=list(b.metas), rank=None), prefix) for b, prefix in shared]
    assert buckets_digests_lazy(apart, mode)() == want
    assert len(want) == len(tensors)
    for pairs in (shared, apart):  # per bucket, then merged as a receiver does (one copy to host where all are on it)
        merged = PendingDigests.merge([buckets_digests_lazy([pair], mode) for pair in pairs])
        if device == "cuda" and mode == "checksum":
            assert merged.device_words is not None
        assert merged() == want
    if mode != "off":  # one byte changed in the arena changes the digest of the tensor it lies in, only
        last = shared[-1][0]
        arena[last.metas[-1].offset + (last.buffer.data_ptr() - arena.data_ptr())] ^= 1
        changed = {k for k, d in buckets_digests_lazy(shared, mode)().items() if want[k] != d}
        assert changed == {shared[-1][1] + last.metas[-1].name}
        arena[last.metas[-1].offset + (last.buffer.data_ptr() - arena.data_ptr())] ^= 1
    on_host = {}  # the same digests where the bytes are host memory (a restore from the host copy)
    for b, prefix in shared:
        on_host.update(bucket_digests(Bucket(buffer=b.buffer.cpu().numpy(), metas=list(b.metas), rank=None), mode, prefix))
    assert on_host == want
