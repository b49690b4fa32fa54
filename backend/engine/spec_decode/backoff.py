"""The back-off: speculate in a step only where speculating has been measured to generate tokens faster.

What speculation is worth depends on things no constant knows: the host (a CPU step is bound by reading the weights
while its rows are few and by compute once they are many, so a verify row of 1 + k tokens costs about a decode row's
time at batch 1 and k more tokens' time at batch 32), the model and draft model, k, and how often this traffic's
proposals are accepted. So the engine measures it: each decode step (no prefill rows in it) is timed from its
scheduling to its outputs, and its generated tokens per second go into an exponential moving average per
(decode-row bucket, speculated or not); buckets are powers of two of the decode rows. A speculative step in which
nothing was proposed says nothing about speculation and is not counted. A step speculates when its bucket's
speculative rate is at least its plain rate. Until each choice of a bucket has MIN_SAMPLES steps, the bucket takes
the one with fewer (speculation first): one noisy step does not decide. Then every PROBE_EVERY steps a bucket takes
the other choice once, so a change in the traffic (acceptance falling or rising) or in the machine's load is seen.
The cost of the probes is bounded by 1 / PROBE_EVERY of the steps of each bucket.

Plain Python over numbers; the clock is the engine's (tests feed their own).
"""
from __future__ import annotations

PROBE_EVERY = 32  # steps of a bucket between two tries of its losing choice
MIN_SAMPLES = 3  # steps of each choice before a bucket compares them
EMA_WEIGHT = 0.25  # weight of the newest step in a rate (noise on a shared host: smooth over ~4 steps)


def bucket(decode_rows: int) -> int:
    """1, 2-3, 4-7, 8-15, ... decode rows share a bucket."""
    return max(1, decode_rows).bit_length()


class BackOff:
    def __init__(self):
        self.rates: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> tokens per second (EMA)
        self.samples: dict[tuple[int, bool], int] = {}  # (bucket, speculated) -> steps measured
        self.steps: dict[int, int] = {}  # bucket -> its decisions so far
        self.last_probe: dict[int, int] = {}  # bucket -> its decision count at its latest probe

    def choose(self, decode_rows: int) -> bool:
        """Speculate in a step with this many decode rows?"""
        b = bucket(decode_rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        ns, np_ = self.samples.get((b, True), 0), self.samples.get((b, False), 0)
        if min(ns, np_) < MIN_SAMPLES:
            return ns <= np_
        best = self.rates[(b, True)] >= self.rates[(b, False)]
        if n - self.last_probe.get(b, 0) >= PROBE_EVERY:
            self.last_probe[b] = n
            return not best
        return best

    def observe(self, decode_rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step's result: tokens generated in `seconds`, with or without speculation."""
        if seconds <= 0 or tokens <= 0:
            return
        key = (bucket(decode_rows), speculated)
        rate = tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + EMA_WEIGHT * (rate - old)
        self.samples[key] = self.samples.get(key, 0) + 1
