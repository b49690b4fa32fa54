"""Decides, each step, how many tokens each request computes (vLLM v1 style: one map, no phases).

Decodes and unfinished prefills of running requests go first, then waiting requests are admitted,
their prompts chunked to fit the token budget. When blocks run out, the most recently admitted running
request is preempted by recompute: its blocks are freed and it goes back to the head of the queue
with its output so far, which is prefilled again when it resumes.

Adapter-aware admission (one rule, one parameter: EngineConfig.max_lora_wait_steps = W). A waiting request's age
is the number of steps it has waited since it was queued (or preempted). Each step admits, in this order:
  1. overdue requests (age >= W), oldest first. One whose adapter is in host memory and still cannot be admitted
     (its rows are pinned by running requests, or blocks are short) stops admission for the step: nothing behind
     it passes it. Its rows are taken from adapters no running request uses (least recently used first);
  2. requests whose adapter holds device rows, or that have none, in queue order: they evict nothing;
  3. the rest in queue order (their adapters are placed, evicting unpinned rows that no request holds first).
Grouping by residency keeps an adapter's rows serving its queued requests instead of being evicted and written
again for every other adapter (FCFS over more adapters than rows thrashes them); W bounds what grouping may cost
any request. The bound: from the step a request r becomes overdue on, no request queued after r is admitted while
r's adapter is in host memory and r waits (whatever came after r is behind it in the order, and r stops the
pass). So what r waits for, rows, blocks, token budget or sequence slots, is released by the requests running
then and taken only by requests queued before r: r waits at most W steps plus what those requests make it wait,
under any mix of adapters. (Time its adapter spends on disk is not bounded by the scheduler: r cannot run then.)
W = 0 is strict arrival order (FCFS).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from loom.engine.core.block_manager import BlockManager
from loom.engine.core.sequence import Sequence, SequenceStatus


class Drafter(Protocol):
    """Speculative decoding's side of scheduling (loom.engine.spec_decode.SpecDecoder)."""

    def active(self, running: list[Sequence]) -> bool:
        """Whether this step speculates at all (the back-off), asked once per step."""

    def draft(self, seq: Sequence, max_tokens: int) -> int:
        """Append up to max_tokens proposals to a decoding seq's token_ids; -> how many."""

    def undo(self, seq: Sequence) -> None:
        """Take its proposals back (no blocks for them)."""


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (1 token) first, then prefills/extends
    num_scheduled_tokens: list[int]  # tokens computed this step, per sequence
    num_decode_seqs: int


# Where a waiting request's adapter is (Scheduler's adapter_state hook; the registry's prefetch() answers it)
ON_DEVICE, IN_HOST, ON_DISK = "device", "host", "disk"  # ON_DISK: still loading, or its load failed


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 can_run: Callable[[Sequence], bool] | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 adapter_state: Callable[[Sequence, bool], str] | None = None, max_lora_wait_steps: int = 0,
                 drafter: Drafter | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Hooks for the adapter registry: may this sequence run now (adapter resident)? it stopped running. Where is
        # its adapter (ON_DEVICE / IN_HOST / ON_DISK), placing it first into rows nobody needs if the flag says so?
        self.can_run = can_run or (lambda seq: True)
        self.on_preempt = on_preempt or (lambda seq: None)
        self.adapter_state = adapter_state or (lambda seq, place: ON_DEVICE)
        self.max_lora_wait_steps = max_lora_wait_steps  # W of the module docstring's rule
        self.drafter = drafter  # speculative decoding: decodes may carry proposals to verify
        self.num_steps = 0  # schedule() calls so far: the clock of the requests' ages
        self._queued_at: dict[Sequence, int] = {}  # waiting sequence -> num_steps when it was queued
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix cache effect at admission: prompt tokens asked for, and those found computed.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._queued_at[seq] = self.num_steps

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.on_preempt(seq)
        self.waiting.appendleft(seq)
        self._queued_at[seq] = self.num_steps
        self.num_preemptions += 1

    def age(self, seq: Sequence) -> int:
        """Steps a waiting sequence has waited since it was queued (or preempted): 0 at its first schedule()."""
        return self.num_steps - 1 - self._queued_at.get(seq, self.num_steps - 1)

    def _admission_order(self) -> tuple[list[Sequence], int]:
        """The waiting sequences in the order of the module docstring's rule, and how many lead it overdue."""
        w = self.max_lora_wait_steps
        overdue: list[Sequence] = []
        resident: list[Sequence] = []
        rest: list[Sequence] = []
        place = True  # prefetch into rows nobody needs until one finds none (the rest would search in vain)
        for seq in self.waiting:
            if self.age(seq) >= w:
                overdue.append(seq)
                continue
            state = ON_DEVICE if seq.adapter is None else self.adapter_state(seq, place)
            if state == ON_DEVICE:
                resident.append(seq)
            else:
                place = place and state != IN_HOST
                rest.append(seq)
        return overdue + resident + rest, len(overdue)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        bs = self.bm.block_size
        # decodes (1 token) and prefills/extends, each in scheduling order (the batch lists decodes first)
        dec: list[Sequence] = []
        pre: list[Sequence] = []
        pre_n: list[int] = []

        # 1) running requests, oldest first; preempt from the newest end when blocks run out. A victim is always
        # at or after position i (popped from the end), so nothing scheduled is ever taken back.
        running = self.running
        drafter = self.drafter if self.drafter is not None and self.drafter.active(running) else None
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n > budget:
                n = budget
            elif n <= 0:  # nothing to compute (cannot happen today; never schedule an empty entry)
                i += 1
                continue
            if n == 1 and drafter is not None and budget > 1:  # a verify row: 1 + k tokens, like a prefill chunk
                n += drafter.draft(seq, budget - 1)
                if n > 1 and not self.bm.allocate(seq, n):  # proposals never preempt anything
                    drafter.undo(seq)
                    n = 1
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

        # 2) waiting requests, in the order of the adapter-aware rule (module docstring; FCFS without adapters).
        order, num_overdue = self._admission_order() if self.waiting else ((), 0)
        admitted: set[Sequence] = set()
        for k, seq in enumerate(order):
            if budget <= 0 or len(running) >= self.max_num_seqs:
                break
            if not self.can_run(seq):  # its adapter is loading, or has no rows now: let others pass unless overdue
                if k < num_overdue and seq.adapter is not None and self.adapter_state(seq, False) == IN_HOST:
                    break
                continue
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, n):
                # Retried next step; the engine refuses up front any request that cannot fit alone.
                self.bm.free_sequence(seq)
                self.on_preempt(seq)  # don't keep its adapter pinned while it waits
                break
            admitted.add(seq)
            del self._queued_at[seq]
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
        if admitted:
            kept = [s for s in self.waiting if s not in admitted]
            self.waiting.clear()
            self.waiting.extend(kept)
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
            self._queued_at.pop(seq, None)
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
            for seq, _ in ending:
                self._queued_at.pop(seq, None)
            kept = [s for s in self.waiting if s.status is not SequenceStatus.FINISHED]
            self.waiting.clear()
            self.waiting.extend(kept)
