"""Decides, each step, how many tokens each request computes (vLLM v1 style: one map, no phases).

Decodes and unfinished prefills of running requests go first, then waiting requests are admitted,
their prompts chunked to fit the token budget. When blocks run out, the most recently admitted running
request is preempted by recompute: its blocks are freed and it goes back to the head of the queue
with its output so far, which is prefilled again when it resumes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from loom.engine.block_manager import BlockManager
from loom.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (1 token) first, then prefills/extends
    num_scheduled_tokens: list[int]  # tokens computed this step, per sequence
    num_decode_seqs: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 can_run: Callable[[Sequence], bool] | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Hooks for the adapter registry: may this sequence run now (adapter resident)? it stopped running.
        self.can_run = can_run or (lambda seq: True)
        self.on_preempt = on_preempt or (lambda seq: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix cache effect at admission: prompt tokens asked for, and those found computed.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.on_preempt(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        bs = self.bm.block_size
        # decodes (1 token) and prefills/extends, each in scheduling order (the batch lists decodes first)
        dec: list[Sequence] = []
        pre: list[Sequence] = []
        pre_n: list[int] = []

        # 1) running requests, oldest first; preempt from the newest end when blocks run out. A victim is always
        # at or after position i (popped from the end), so nothing scheduled is ever taken back.
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n > budget:
                n = budget
            elif n <= 0:  # nothing to compute (cannot happen today; never schedule an empty entry)
                i += 1
                continue
            if seq.num_computed_tokens + n > len(seq.block_table) * bs:  # needs blocks
                preempted_self = False
                while not self.bm.allocate(seq, n):
                    victim = running.pop()
                    self._preempt(victim)
                    if victim is seq:
                        preempted_self = True
                        break
                if preempted_self:
                    continue
            if n == 1:
                dec.append(seq)
            else:
                pre.append(seq)
                pre_n.append(n)
            budget -= n
            i += 1

        # 2) waiting requests, in arrival order (preempted ones are at the front).
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.can_run(seq):  # e.g. its adapter is still loading: let others pass
                skipped.append(self.waiting.popleft())
                continue
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, n):
                # Retried next step; the engine refuses up front any request that cannot fit alone.
                self.bm.free_sequence(seq)
                self.on_preempt(seq)  # don't keep its adapter pinned while it waits
                break
            self.waiting.popleft()
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens
            if not seq.ever_scheduled:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            running.append(seq)
            if n == 1:
                dec.append(seq)
            else:
                pre.append(seq)
                pre_n.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return ScheduledBatch(dec + pre, [1] * len(dec) + pre_n, len(dec))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free_sequence(seq)

    def finish_many(self, ending: list[tuple[Sequence, str]]) -> None:
        """finish() for many sequences with one pass over each queue (many end in the same step)."""
        was_waiting = False
        for seq, reason in ending:
            was_waiting = was_waiting or seq.status is SequenceStatus.WAITING
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            self.bm.free_sequence(seq)
        self.running[:] = [s for s in self.running if s.status is not SequenceStatus.FINISHED]
        if was_waiting:
            kept = [s for s in self.waiting if s.status is not SequenceStatus.FINISHED]
            self.waiting.clear()
            self.waiting.extend(kept)
