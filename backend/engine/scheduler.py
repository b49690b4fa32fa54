"""Decides, each step, how many tokens each request computes (vLLM v1 style: one map, no phases).

Decodes and unfinished prefills of running requests go first, then waiting requests are admitted,
their prompts chunked to fit the token budget. When blocks run out, the most recently admitted running
request is preempted by recompute: its blocks are freed and it goes back to the head of the queue
with its output so far, which is prefilled again when it resumes.
"""
from __future__ import annotations

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
        scheduled: dict[Sequence, int] = {}

        # 1) running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running.pop()
                scheduled.pop(victim, None)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = n
                budget -= n
                i += 1

        # 2) waiting requests, in arrival order (preempted ones are at the front).
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            self.running.append(seq)
            scheduled[seq] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        seqs = list(scheduled)
        seqs.sort(key=lambda s: scheduled[s] != 1)  # stable: decodes first
        counts = [scheduled[s] for s in seqs]
        return ScheduledBatch(seqs, counts, sum(1 for n in counts if n == 1))

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
