"""KV-cache blocks: on-demand allocation, ref counts, and automatic prefix caching with an LRU pool.

A full block is cached under the key (parent entry id, adapter version, its token ids). Dict lookup compares
keys by equality, so a hash collision can never return another prefix's KV; the parent *entry id*
(not the parent's hash) chains blocks, and an id dies with its entry, so a stale chain never matches.
Plain Python over integers: no torch here.

Bookkeeping grows with the blocks in use or cached, never with the cache's size: a small model given most of a
large GPU has tens of millions of blocks, and one Python object (or free-list entry) per block would take
seconds and gigabytes at start. Blocks never used yet are the range [next_fresh, num_blocks); a freed block
goes to the plain free list (reused first, last freed first) or, when it holds registered content, to the
cached free pool (reused last, least recently freed first, its content findable until then).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from loom.engine.core.sequence import Sequence


class BlockInfo(NamedTuple):
    ref_count: int
    key: tuple | None  # prefix-cache key when the block is full and registered
    entry_id: int  # identity of the registered content (0 = none)


class _BlockView:
    """Read-only per-block view (tests and debugging): bm.blocks[i].ref_count / .key / .entry_id."""

    def __init__(self, bm: "BlockManager"):
        self._bm = bm

    def __len__(self) -> int:
        return self._bm.num_blocks

    def __getitem__(self, block_id: int) -> BlockInfo:
        if not 0 <= block_id < self._bm.num_blocks:
            raise IndexError(block_id)
        key, entry = self._bm._content.get(block_id, (None, 0))
        return BlockInfo(self._bm._refs.get(block_id, 0), key, entry)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory_bytes")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._refs: dict[int, int] = {}  # block id -> ref count, for blocks in use only
        self._content: dict[int, tuple[tuple, int]] = {}  # block id -> (key, entry id) of registered blocks
        self._next_fresh = 0  # blocks [next_fresh, num_blocks) were never used
        self._free_plain: list[int] = []  # free, nothing cached: reused first (a stack)
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free with cached content, oldest first
        self.cached: dict[tuple, int] = {}  # key -> block id
        self._next_entry_id = 1
        self._next_epoch = 1
        self.blocks = _BlockView(self)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + (self.num_blocks - self._next_fresh) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds: the most one sequence (prompt and output) can ever reach."""
        return self.num_blocks * self.block_size

    def _new_epoch(self, seq: Sequence) -> None:
        """seq's block table changed other than by appending (Sequence.table_epoch)."""
        seq.table_epoch = self._next_epoch
        self._next_epoch += 1

    def entry_id(self, block_id: int) -> int:
        return self._content[block_id][1]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- prefix cache --------------------------------------------------------------------------
    def _key(self, parent_entry: int, adapter_version: int, tokens: list[int]) -> tuple:
        return (parent_entry, adapter_version, tuple(tokens))

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached prefix of a sequence that has no blocks yet (one token at least is left to
        compute)."""
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
            parent = self._content[block_id][1]
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = hits
        self._new_epoch(seq)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * bs

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: put newly completed blocks (all tokens computed) into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = (seq.num_computed_tokens - seq.num_draft_tokens) // bs  # drafts may be rejected: never cached
        parent = self.entry_id(seq.block_table[seq.num_hashed_blocks - 1]) if seq.num_hashed_blocks else 0
        for i in range(seq.num_hashed_blocks, n_full):
            block_id = seq.block_table[i]
            key = self._key(parent, seq.adapter_version, seq.token_ids[i * bs:(i + 1) * bs])
            existing = self.cached.get(key)
            if existing is None:
                self._content[block_id] = (key, self._next_entry_id)
                self._next_entry_id += 1
                self.cached[key] = block_id
            elif existing != block_id:
                # Same content computed twice (two requests prefilling one prefix in one step): the sequence
                # adopts the registered copy and drops its own, so every hashed block of a table is a
                # registered one and the next block's parent can be read from the table.
                self._ref(existing)
                seq.block_table[i] = existing
                self._new_epoch(seq)
                self._unref(block_id)
            parent = self.entry_id(seq.block_table[i])
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, n_full)

    # ---- allocation ----------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        n = self._refs.get(block_id, 0)
        if n == 0:  # a free block is found again only through the cache
            del self._free_cached[block_id]
        self._refs[block_id] = n + 1

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.pop()
        elif self._next_fresh < self.num_blocks:
            block_id = self._next_fresh
            self._next_fresh += 1
        else:  # evict the least recently freed cached content
            block_id, _ = self._free_cached.popitem(last=False)
            key, _ = self._content.pop(block_id)
            if self.cached.get(key) == block_id:
                del self.cached[key]
        self._refs[block_id] = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq; False (and nothing changed) if blocks run out."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        if need and not seq.block_table:
            self._new_epoch(seq)
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
        if rest and not self.num_free_blocks:
            return False
        for block_id in src.block_table[:n_full]:
            self._ref(block_id)
        dst.block_table = list(src.block_table[:n_full])
        self._new_epoch(dst)
        copy = None
        if rest:
            new = self._take_free_block()
            dst.block_table.append(new)
            copy = (src.block_table[n_full], new)
        dst.num_computed_tokens = src.num_computed_tokens
        dst.num_hashed_blocks = min(src.num_hashed_blocks, n_full)
        return copy

    def _unref(self, block_id: int) -> None:
        n = self._refs[block_id] - 1
        if n:
            self._refs[block_id] = n
            return
        del self._refs[block_id]
        if block_id in self._content:  # keep it findable; reused last
            self._free_cached[block_id] = None
        else:  # nothing worth keeping: reuse first
            self._free_plain.append(block_id)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past those holding seq's computed tokens (speculative decoding rolled its length back:
        they held only rejected drafts, and were never registered)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) <= keep:
            return
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]
        self._new_epoch(seq)  # entries past `keep` will be other blocks: the runner rewrites the row

    def free_sequence(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are reused before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.table_epoch = 0
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
