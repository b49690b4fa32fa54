"""Block bookkeeping that does not grow with the cache: start-up cost and memory independent of the number of
blocks, and the reuse order of the old one-object-per-block manager (freed plain blocks first, last freed
first; then never-used blocks; cached content last, least recently freed first)."""
from __future__ import annotations

import time
import tracemalloc

from loom.engine.core.block_manager import BlockManager
from loom.engine.core.sequence import Sequence
from loom.engine.sampling_params import SamplingParams


def _seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), 0)


def test_start_up_does_not_grow_with_the_cache():
    tracemalloc.start()
    t = time.process_time()
    bm = BlockManager(50_000_000, 16)  # a tiny model with most of a large GPU
    elapsed = time.process_time() - t
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 100_000 and elapsed < 0.5, (size, elapsed)  # one object per block: gigabytes, seconds
    assert bm.num_free_blocks == 50_000_000 and bm.num_used_blocks == 0
    s = _seq(range(40))
    assert bm.allocate(s, 40) and s.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 50_000_000 - 3


def test_reuse_order_and_eviction():
    bm = BlockManager(6, 4)
    a, b = _seq(range(8), "a"), _seq(range(100, 108), "b")
    assert bm.allocate(a, 8) and bm.allocate(b, 8)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    a.num_computed_tokens = 8
    bm.register_full_blocks(a)  # a's blocks hold cached content
    bm.free_sequence(a)
    bm.free_sequence(b)  # plain blocks, freed tail first: 3, then 2
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0
    c = _seq(range(200, 224), "c")
    assert bm.allocate(c, 24)
    # plain blocks last-freed first (2, then 3), never-used (4, 5), then cached ones oldest first (1, then 0)
    assert c.block_table == [2, 3, 4, 5, 1, 0]
    assert not bm.cached and bm.blocks[1].key is None and bm.blocks[0].ref_count == 1


def test_a_cached_free_block_is_found_again():
    bm = BlockManager(4, 4)
    a = _seq(range(9), "a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.register_full_blocks(a)
    first = list(a.block_table)
    bm.free_sequence(a)
    again = _seq(range(9), "again")
    bm.match_prefix(again)
    assert again.block_table == first[:2] and again.num_computed_tokens == 8
    assert bm.blocks[first[0]].ref_count == 1 and bm.num_used_blocks == 2
    info = bm.blocks[first[1]]
    assert info.key[0] == bm.blocks[first[0]].entry_id  # chained to its parent's entry
