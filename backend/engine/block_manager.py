"""KV-cache blocks: on-demand allocation, ref counts, and automatic prefix caching with an LRU pool.

A full block is cached under the key (parent entry id, adapter version, its token ids). Dict lookup compares
keys by equality, so a hash collision can never return another prefix's KV; the parent *entry id*
(not the parent's hash) chains blocks, and an id dies with its entry, so a stale chain never matches.
Plain Python over integers: no torch here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loom.engine.sequence import Sequence


@dataclass
class _Block:
    ref_count: int = 0
    key: tuple | None = None  # prefix-cache key when the block is full and registered
    entry_id: int = 0  # identity of the registered content (0 = none)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory_bytes")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [_Block() for _ in range(num_blocks)]
        # Blocks with ref_count 0, oldest first; cached ones stay findable until reused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[tuple, int] = {}  # key -> block id
        self._next_entry_id = 1

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- prefix cache --------------------------------------------------------------------------
    def _key(self, parent_entry: int, adapter_version: int, tokens: list[int]) -> tuple:
        return (parent_entry, adapter_version, tuple(tokens))

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached prefix of a sequence that has no blocks yet (at least one token is left to compute)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.prompt_logprobs_pending:
            return  # prompt logprobs need every prompt position computed (vLLM skips the cache for them too)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # the last token must be computed to get logits
        parent, hits = 0, []
        for i in range(max_blocks):
            block_id = self.cached.get(self._key(parent, seq.adapter_version, seq.token_ids[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.blocks[block_id].entry_id
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = hits
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * bs

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: put newly completed blocks (all tokens computed) into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].entry_id if seq.num_hashed_blocks else 0
        for i in range(seq.num_hashed_blocks, n_full):
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            key = self._key(parent, seq.adapter_version, seq.token_ids[i * bs:(i + 1) * bs])
            existing = self.cached.get(key)
            if existing is None:
                block.key, block.entry_id = key, self._next_entry_id
                self._next_entry_id += 1
                self.cached[key] = block_id
            elif existing != block_id:
                # Same content computed twice (two requests prefilling one prefix in one step): the sequence
                # adopts the registered copy and drops its own, so every hashed block of a table is a
                # registered one and the next block's parent can be read from the table.
                self._ref(existing)
                seq.block_table[i] = existing
                self._unref(block_id)
            parent = self.blocks[seq.block_table[i]].entry_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, n_full)

    # ---- allocation ----------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict its cached content
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key, block.entry_id = None, 0
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq; False (and nothing changed) if blocks run out."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def fork(self, src: Sequence, dst: Sequence) -> tuple[int, int] | None | bool:
        """Let `dst` (no blocks yet) share `src`'s computed blocks. A partly filled last block cannot be shared
        (both would write their next tokens into it): `dst` gets a fresh block and the caller copies the KV of
        (src block, dst block), the pair returned. None: nothing to copy; False: no free block (nothing changed)."""
        assert not dst.block_table
        bs = self.block_size
        n_full, rest = divmod(src.num_computed_tokens, bs)
        if rest and not self.free:
            return False
        for block_id in src.block_table[:n_full]:
            self._ref(block_id)
        dst.block_table = list(src.block_table[:n_full])
        copy = None
        if rest:
            new = self._take_free_block()
            dst.block_table.append(new)
            copy = (src.block_table[n_full], new)
        dst.num_computed_tokens = src.num_computed_tokens
        dst.num_hashed_blocks = min(src.num_hashed_blocks, n_full)
        return copy

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.key is None:  # nothing worth keeping: reuse first
                self.free.move_to_end(block_id, last=False)

    def free_sequence(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are reused before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
