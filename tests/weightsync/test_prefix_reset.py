"""The prefix-cache reset a push's pause runs (worker_ext.install_fast_prefix_reset), on vLLM's
own BlockPool: it leaves the pool exactly as vLLM's reset does, while clearing only the blocks that
hold a hash."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core import block_pool as bp  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id  # noqa: E402

from asyncrl.generator.worker_ext import install_fast_prefix_reset  # noqa: E402


def _pool_with_cached_blocks(n: int = 64, cached: int = 5, shared: int = 2) -> tuple[bp.BlockPool, list]:
    """A pool whose first `cached` allocated blocks were hashed (two of them under one hash, as
    vLLM keeps duplicates) and freed again: free, but prefix-cache hits until a reset."""
    pool = bp.BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(cached + shared)
    for i, block in enumerate(blocks[:cached]):
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(bytes([i]) * 32), 0), block, 16)
    same = make_block_hash_with_group_id(BlockHash(b"\xff" * 32), 0)
    for block in blocks[cached:]:
        pool._insert_block_hash(same, block, 16)
    pool.free_blocks(blocks)
    return pool, blocks


def _state(pool: bp.BlockPool) -> tuple:
    return (len(pool.cached_block_hash_to_block._cache), dict(pool.cached_block_hashes_by_block),
            [b.block_hash for b in pool.blocks], pool.get_num_free_blocks(), len(pool.blocks))


def test_the_fast_reset_leaves_the_pool_as_vllms_own_and_touches_only_hashed_blocks(monkeypatch):
    cleared: list[int] = []
    reset_hash = KVCacheBlock.reset_hash

    def counting(self):
        cleared.append(self.block_id)
        return reset_hash(self)

    monkeypatch.setattr(KVCacheBlock, "reset_hash", counting)
    vllm_reset = getattr(bp.BlockPool.reset_prefix_cache, "__wrapped__", bp.BlockPool.reset_prefix_cache)
    reference, _ = _pool_with_cached_blocks()
    assert len(reference.cached_block_hash_to_block._cache) == 6 and sum(b.block_hash is not None for b in reference.blocks) == 7
    assert vllm_reset(reference) is True
    want = _state(reference)
    assert len(cleared) == 64  # vLLM's own: every block of the pool

    assert install_fast_prefix_reset() and install_fast_prefix_reset()  # idempotent
    assert bp.BlockPool.reset_prefix_cache._asyncrl_fast and bp.BlockPool.reset_prefix_cache.__wrapped__ is vllm_reset
    pool, hashed = _pool_with_cached_blocks()
    cleared.clear()
    assert pool.reset_prefix_cache() is True
    assert _state(pool) == want  # no hash left anywhere, every block free, the block list intact
    assert sorted(cleared) == sorted(b.block_id for b in hashed)  # only the 7 that held a hash

    # A pool with a block still in use refuses the reset, as vLLM's does, and changes nothing.
    busy, _ = _pool_with_cached_blocks()
    held = busy.get_new_blocks(1)
    before = _state(busy)
    assert held and busy.reset_prefix_cache() is False and _state(busy) == before
