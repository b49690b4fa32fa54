"""The workload and the statistics of a serving benchmark (scripts/bench_serving.py), which need no server.

A workload is a list of `Req` (a prompt of ordinary English text of a drawn token length, an exact number of output
tokens, an adapter); a run gives one `Result` per request (send time, the chunks of tokens and when each came, the
end). `summarize_run` gives TTFT, inter-token and end-to-end latency percentiles and output tokens/s; `alternating`
runs systems round by round, the first to go rotating, and `round_ratios` compares two systems round by round, the
TTFT a server adds taken request by request (`paired_ttft_added`).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Callable

import harness.bench as bc


@dataclass
class Req:
    text: str
    prompt_len: int
    max_tokens: int
    lora: str | None = None


def draw_len(rng: random.Random, mean: int, r: float) -> int:
    if r <= 0:
        return max(1, mean)
    return max(1, rng.randint(int(mean * (1 - r)), int(mean * (1 + r))))


def make_workload(tok, n: int, isl: int, isl_r: float, osl: int, osl_r: float, seed: int) -> list[Req]:
    """Prompts are token slices of the ordinary sentences, decoded to text (the server re-encodes them)."""
    rng = random.Random(seed)
    corpus = tok.encode(" ".join(bc.PROMPTS), add_special_tokens=False)
    reqs = []
    for _ in range(n):
        want = draw_len(rng, isl, isl_r)
        start = rng.randrange(len(corpus))
        ids = [corpus[(start + k) % len(corpus)] for k in range(want)]
        text = tok.decode(ids).strip() or "Hello"
        reqs.append(Req(text, len(tok.encode(text, add_special_tokens=False)), draw_len(rng, osl, osl_r)))
    return reqs


@dataclass
class Result:
    idx: int
    t_send: float = 0.0
    round: int = 0  # which round of a --rounds run (the run's duration sums the rounds' spans)
    chunks: list = field(default_factory=list)  # (time, tokens in the chunk)
    t_end: float = 0.0
    error: str | None = None
    # TTFT waterfall (time.monotonic(), comparable with the server's): send, first token received, and the
    # server's (or the in-process engine's) stage timestamps
    t_send_mono: float = 0.0
    t_first_mono: float = 0.0
    stages: dict | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first chunk (None: no chunk came)."""
        return self.chunks[0][0] - self.t_send if self.chunks else None


def summarize_run(results: list[Result], reqs: list[Req]) -> dict:
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = [r.ttft for r in ok]
    e2e = [r.t_end - r.t_send for r in ok]
    itl = [(r.t_end - r.t_send - r.ttft) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in ok)
    spans: dict[int, tuple[float, float]] = {}
    for r in results:
        a, b = spans.get(r.round, (r.t_send, r.t_end))
        spans[r.round] = (min(a, r.t_send), max(b, r.t_end))
    dur = max(sum(b - a for a, b in spans.values()), 1e-9)
    short = sum(1 for r in ok if r.num_tokens != reqs[r.idx].max_tokens)
    errors = [r.error for r in results if r.error is not None]
    return {"requests": len(results), "ok": len(ok), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "wrong_token_count": short, "output_tokens": tokens, "duration_s": dur, "output_tok_s": tokens / dur,
            "req_s": len(ok) / dur, "ttft_s": bc.summarize(ttft), "itl_s": bc.summarize(itl),
            "e2e_s": bc.summarize(e2e),
            "per_request": [{"ttft": r.ttft, "e2e": r.t_end - r.t_send,
                             "tokens": r.num_tokens, "error": r.error} for r in results]}


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start: all 0 (concurrency mode) or a Poisson process of `rate` per second."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed + 7)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out



def alternating(rounds: int, runners: dict[str, Callable[[int], list[Result]] | None]) -> dict[str, list[list[Result]]]:
    """Run every system (None: not run) `rounds` times, the first to go rotating from round to round, so a slow
    stretch of the machine falls on both; -> each system's results per round (Result.round set)."""
    names = [n for n, run in runners.items() if run is not None]
    out: dict[str, list[list[Result]]] = {n: [] for n in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            res = runners[name](k)
            for r in res:
                r.round = k
            out[name].append(res)
    return out


def paired_ttft_added(tri: list[list[Result]], off: list[list[Result]]) -> list[float]:
    """Each request's TTFT through Triton minus the same request's in-process in the same round (ms): the request's
    own prefill time, which varies far more from one prompt to the next than the serving path adds, cancels out."""
    out = []
    for a, b in zip(tri, off):
        theirs = {r.idx: r for r in b if r.error is None and r.chunks}
        for r in a:
            o = theirs.get(r.idx)
            if o is not None and r.error is None and r.chunks:
                out.append((r.ttft - o.ttft) * 1e3)
    return out


def round_ratios(tri: list[list[Result]], off: list[list[Result]], reqs: list[Req]) -> dict:
    """Per round, Triton against in-process: tokens/s ratio and TTFT p50 added (ms); their medians; and the median
    over all requests of paired_ttft_added()."""
    tok, added = [], []
    for a, b in zip(tri, off):
        sa, sb = summarize_run(a, reqs), summarize_run(b, reqs)
        tok.append(bc.ratio(sa["output_tok_s"], sb["output_tok_s"]))
        added.append((sa["ttft_s"]["p50"] - sb["ttft_s"]["p50"]) * 1e3)
    pairs = paired_ttft_added(tri, off)
    return {"tok_s_ratio": tok, "ttft_p50_added_ms": added, "tok_s_ratio_median": statistics.median(tok),
            "ttft_p50_added_ms_median": statistics.median(added), "ttft_pairs": len(pairs),
            "ttft_added_paired_ms_median": statistics.median(pairs) if pairs else float("nan")}


def paired_rounds(rounds: int, triton: Callable[[int], list[Result]],
                  in_process: Callable[[int], list[Result]] | None, reqs: list[Req]):
    """alternating() for Triton and in-process (None: Triton alone) -> each side's results of every round in one
    list (None for a side not run) and, with the in-process side, round_ratios() (else None)."""
    got = alternating(rounds, {"triton": triton, "offline": in_process})
    flat = {name: [r for rnd in res for r in rnd] for name, res in got.items()}
    per_round = round_ratios(got["triton"], got["offline"], reqs) if in_process is not None else None
    return flat["triton"], flat.get("offline"), per_round


def round_line(label: str, rr: dict) -> str:
    return (f"{label}: per round ({len(rr['tok_s_ratio'])}, order alternating) tok/s triton / in-process "
            f"{', '.join(f'{x:.2f}' for x in rr['tok_s_ratio'])} (median {rr['tok_s_ratio_median']:.2f}); "
            f"TTFT p50 added {', '.join(f'{x:+.1f}' for x in rr['ttft_p50_added_ms'])} ms "
            f"(median {rr['ttft_p50_added_ms_median']:+.1f}); TTFT added request by request (same request, same "
            f"round) median {rr['ttft_added_paired_ms_median']:+.1f} ms over {rr['ttft_pairs']} pairs")

