#!/usr/bin/env python3
"""The host side of an engine step, with the model's forward replaced by a no-op, in microseconds per step.

Decoding steady state at 64, 256 and 1024 running sequences: every request is prefilled first, then a few untimed
decode steps, then --steps timed steps. The model runner's `run` is patched to do only the input preparation
(`runner.prepare`) and return precomputed logits of the right shape, so a step is all host work plus the
sampler's tensor math. Phases:

    schedule       scheduler + block allocation
    prepare        the runner's input preparation (flattening, positions, slot mapping, block tables)
    state          the sampling tensors of the step (persistent state: a gather; simple path: rebuilt from lists)
    sampler        the sampler's tensor math (scales with the vocabulary; ~nothing at --vocab 256)
    outputs        output processing: tokens into place, stop checks, StepOutputs
    rest           the rest of the step (forks, the device-to-host copy, bookkeeping)

Each size runs the engine's sampling path ("persistent") and the simple path (SamplingBatch.build from the
sequences' lists every step) in the same process. With --vocab 256 the sampler's math is negligible on CPU and
what remains is host work. Other parts, each in the same run:

    --sampler        the sampler alone at the vocabulary: greedy without logprobs vs a bare argmax (and with
                     logprobs, random sampling, and the log_softmax the previous sampler did every step)
    --serving        the serving side through AsyncEngine (loop thread, detokenization, cancellation polling at
                     ~0.1 ms a call like Triton's is_cancelled, a streamer whose send builds response arrays),
                     streaming outputs consumed: per step, loop-thread time beyond engine.step and off-loop time
    --device-ms MS   a fake device that takes MS per step: synchronous vs async scheduling, ms per step
    --baseline DIR   also run DIR/scripts/bench_overhead.py (another checkout, e.g. the code before a change)
                     with the same sizes, and print its table

    python scripts/bench_overhead.py                              # vocab 49152, 64 256 1024 sequences
    python scripts/bench_overhead.py --vocab 256 --threads 1      # host work only
    python scripts/bench_overhead.py --vocab 256 --threads 1 --sampler --serving --device-ms 20
    python scripts/bench_overhead.py --vocab 256 --baseline ../loom-before
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness.bench as bc  # noqa: I001  (CPU tuning before torch)

PHASES = ("schedule", "prepare", "state", "sampler", "outputs")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024], help="running sequences")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per size")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (sets block-table width)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size of the stand-in model (256: host only)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N] (where prepare's tensors and the logits live)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--paths", nargs="+", default=["persistent", "simple"], choices=("persistent", "simple"))
    ap.add_argument("--sampler", action="store_true", help="the sampler alone vs a bare argmax")
    ap.add_argument("--sampler-vocab", type=int, default=49152)
    ap.add_argument("--serving", action="store_true", help="the serving side through AsyncEngine")
    ap.add_argument("--serving-seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--device-ms", type=float, default=0.0, help="fake device ms per step: sync vs async scheduling")
    ap.add_argument("--baseline", default=None, help="a checkout whose scripts/bench_overhead.py runs too")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def make_tiny_model(path: str, vocab: int, max_pos: int) -> str:
    """The stand-in model: 2 layers of hidden size 64, tied embeddings, transformers' default init (std 0.02)."""
    from harness.hf_models import make_tiny_llama

    return make_tiny_llama(path, seed=0, vocab=vocab, max_position_embeddings=max_pos, tie_word_embeddings=True,
                           initializer_range=0.02)


def max_new_tokens(num_seqs: int, args) -> int:
    """Enough that no sequence finishes before the timed steps end: sequences admitted first already
    decode while the later prompts are still being prefilled (one chunk of the token budget per step)."""
    prefill_steps = -(-num_seqs * args.prompt_len // max(num_seqs, 8192))
    return prefill_steps + args.warmup_steps + args.steps + 8


class Timer:
    def __init__(self):
        self.total = 0.0
        self.on = False

    def wrap(self, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
        return timed


def make_engine(model_dir: str, num_seqs: int, args, max_tokens: int, **cfg_kw):
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine

    per_seq_blocks = -(-(args.prompt_len + max_tokens + 1) // args.block_size) + 1
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * args.block_size  # tiny model: 2 layers x (K, V) x 2 heads x 16 x f32
    cfg = EngineConfig(model=model_dir, dtype="float32", device=args.device, block_size=args.block_size,
                       kv_cache_memory_bytes=bytes_per_block * (per_seq_blocks * num_seqs + 16),
                       max_num_seqs=num_seqs, max_num_batched_tokens=max(num_seqs, 8192), enable_prefix_caching=True,
                       **cfg_kw)
    return LLMEngine(cfg, load_tokenizer=False)


def noop_forward(engine, prepare=None):
    runner = engine.runner
    pool = torch.randn(max(engine.config.max_num_seqs, 1), runner.vocab_size, device=runner.device)
    prep = prepare or runner.prepare

    def run(batch, lora, extra_rows=None, fill=None):
        ids, ctx, sampled = prep(batch, lora, extra_rows, fill=fill)
        return pool[:len(sampled)], sampled
    return run


def add_requests(engine, num_seqs: int, args, max_tokens: int, prefix: str = "s") -> None:
    from loom.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(num_seqs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        ids = torch.randint(3, engine.runner.vocab_size, (args.prompt_len,), generator=g).tolist()  # no prefix hits
        engine.add_request(f"{prefix}{i}", ids, params)


def prefill(engine) -> int:
    steps = 0
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
        steps += 1
    return steps


def measure(model_dir: str, num_seqs: int, args, path: str) -> dict:
    import harness.simple_sampling as simple

    max_tokens = max_new_tokens(num_seqs, args)
    engine = make_engine(model_dir, num_seqs, args, max_tokens, async_scheduling=False)  # both paths synchronous
    # as the server does once the model is loaded (backend/model.py): the start-up heap is left out of the
    # collector's passes, which otherwise stall a step now and then (tens of ms at 1,024 sequences)
    gc.collect()
    gc.freeze()
    if path == "simple":
        simple.use_simple_sampling(engine)
    timers = {k: Timer() for k in PHASES}
    engine.runner.run = noop_forward(engine, timers["prepare"].wrap(engine.runner.prepare))
    engine.scheduler.schedule = timers["schedule"].wrap(engine.scheduler.schedule)
    engine.sampler = timers["sampler"].wrap(engine.sampler)
    engine._finish_step = timers["outputs"].wrap(engine._finish_step)
    orig_build = simple.SamplingBatch.build
    if path == "simple":
        simple.SamplingBatch.build = timers["state"].wrap(orig_build)
    else:
        engine.sampling_state.batch = timers["state"].wrap(engine.sampling_state.batch)
    try:
        add_requests(engine, num_seqs, args, max_tokens)
        steps = prefill(engine)
        for _ in range(args.warmup_steps):
            engine.step()
        assert len(engine.scheduler.running) == num_seqs, "not all sequences are running"
        for t in timers.values():
            t.on = True
        step_times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            outs = engine.step()
            step_times.append(time.perf_counter() - t)
            assert len(outs) == num_seqs
    finally:
        simple.SamplingBatch.build = orig_build
    n = args.steps
    s = bc.summarize(x * 1e6 for x in step_times)
    res = {"num_seqs": num_seqs, "path": path, "steps": n, "prefill_steps": steps,
           "step_us": s["mean"], "step_us_p50": s["p50"], "step_us_p99": s["p99"],
           "block_table_width": max(len(q.block_table) for q in engine.scheduler.running)}
    for k, t in timers.items():
        res[f"{k}_us"] = t.total / n * 1e6
    res["rest_us"] = res["step_us"] - sum(res[f"{k}_us"] for k in PHASES)
    res["host_us"] = res["step_us"] - res["sampler_us"]
    res["per_seq_us"] = res["step_us"] / num_seqs
    for i in range(num_seqs):
        engine.abort_request(f"s{i}")
    engine.step()
    assert engine.block_manager.num_used_blocks == 0
    gc.unfreeze()
    return res


# ---- the sampler alone ---------------------------------------------------------------------------------------

def time_fn(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def measure_sampler(num_seqs: int, args) -> dict:
    """Microseconds per call on [num_seqs, V] logits: the engine's greedy batch without logprobs vs argmax."""
    from loom.engine.core.sequence import Sequence
    from loom.engine.sample.sampler import Sampler
    from loom.engine.sample.sampling_state import SamplingState
    from loom.engine.sampling_params import SamplingParams
    from loom.engine.worker.step_buffers import StepBuffers

    V = args.sampler_vocab
    dev = torch.device(args.device)
    logits = torch.randn(num_seqs, V, device=dev)
    sampler = Sampler()
    reps = max(3, min(50, int(2e8 / (num_seqs * V))))
    out = {"num_seqs": num_seqs, "vocab": V}

    def batch_of(params: SamplingParams):
        state = SamplingState(V, dev, StepBuffers({}, dev))
        seqs = [Sequence(f"x{i}", [5, 6, 7], params, i) for i in range(num_seqs)]
        rows = np.asarray([state.join(s, (2,)) for s in seqs], dtype=np.int64)
        return state, seqs, rows

    def sampler_call(params: SamplingParams):
        state, seqs, rows = batch_of(params)

        def call():
            state.buffers.begin()
            b, _ = state.batch(seqs, rows)
            return sampler(logits, b).token_ids.cpu()
        return call

    from loom.kernels import argmax

    # the bare argmax: the op greedy sampling runs (on CPU loom's C++ pass, on CUDA torch's); torch's for reference
    out["argmax_us"] = time_fn(lambda: argmax(logits).cpu(), reps)
    out["torch_argmax_us"] = time_fn(lambda: logits.argmax(dim=-1).cpu(), reps)
    out["greedy_us"] = time_fn(sampler_call(SamplingParams(temperature=0.0)), reps)
    out["greedy_logprobs_us"] = time_fn(sampler_call(SamplingParams(temperature=0.0, logprobs=1)), reps)
    out["random_us"] = time_fn(sampler_call(SamplingParams(temperature=1.0, seed=1)), reps)
    # what the previous sampler added to every step: a full log_softmax, then the sampled token's logprob
    tok = logits.argmax(dim=-1)
    out["old_log_softmax_us"] = time_fn(lambda: torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).cpu(), reps)
    out["greedy_x_argmax"] = out["greedy_us"] / out["argmax_us"]
    out["old_greedy_x_argmax"] = (out["argmax_us"] + out["old_log_softmax_us"]) / out["argmax_us"]
    return out


# ---- a fake device: synchronous vs async scheduling ------------------------------------------------------------

class FakeDevice:
    """A stream taking `step_s` per launched step; an event's synchronize() sleeps until its step is done."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.busy_until = 0.0

    def launch(self) -> None:
        self.busy_until = max(self.busy_until, time.monotonic()) + self.step_s

    def event(self):
        until = self.busy_until

        class Event:
            def synchronize(self):
                time.sleep(max(0.0, until - time.monotonic()))
        return Event()


def measure_overlap(model_dir: str, num_seqs: int, args) -> dict:
    res = {"num_seqs": num_seqs, "device_ms": args.device_ms}
    tokens = {}
    for mode in ("sync", "async"):
        max_tokens = max_new_tokens(num_seqs, args)
        engine = make_engine(model_dir, num_seqs, args, max_tokens)
        engine.async_scheduling = mode == "async"  # the config's is CUDA only: the fake device stands in for one
        dev = FakeDevice(args.device_ms / 1e3)
        runner = engine.runner
        table = torch.randn(97, runner.vocab_size, generator=torch.Generator().manual_seed(3))

        # logits a function of (last token, position), so tokens do not depend on a sequence's row in the step
        def run(batch, lora, extra_rows=None, fill=None, runner=runner, dev=dev, table=table):
            ids, ctx, sampled = runner.prepare(batch, lora, extra_rows, fill=fill)
            idx = ctx.logits_indices
            dev.launch()
            return table[(ids[idx] * 7 + ctx.positions[idx] * 3) % 97], sampled
        engine.runner.run = run
        engine._new_event = dev.event
        add_requests(engine, num_seqs, args, max_tokens)
        got: dict[str, list[int]] = {}

        def step(engine=engine, got=got):
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                              for s in engine.scheduler.running):
            step()  # prefill
        for _ in range(args.warmup_steps):
            step()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        res[f"{mode}_ms"] = (time.perf_counter() - t) / args.steps * 1e3
        while engine.has_unfinished_requests():  # drain: compare whole outputs (async is one step behind)
            step()
        tokens[mode] = got
    res["same_tokens"] = tokens["sync"] == tokens["async"]
    return res


# ---- the serving side ---------------------------------------------------------------------------------------

def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure_serving(model_dir: str, num_seqs: int, args) -> dict:
    """Steps of the no-op engine through AsyncEngine with streamed outputs consumed, against engine.step alone."""
    from transformers import AutoTokenizer

    from loom.engine.sampling_params import SamplingParams
    from loom.serving.async_engine import AsyncEngine
    from loom.serving.response_streamer import ResponseStreamer

    tok = AutoTokenizer.from_pretrained(bc.default_model_dir())
    steps = args.steps
    max_tokens = steps + args.warmup_steps + 4
    engine = make_engine(model_dir, num_seqs, args, max_tokens)
    engine.tokenizer = tok
    engine.runner.run = noop_forward(engine)
    vocab = engine.runner.vocab_size
    step_timer, polls = Timer(), [0]
    step_timer.on = True
    engine.step = step_timer.wrap(engine.step)
    sent = {"sends": 0, "tokens": 0, "build_s": 0.0}
    done = threading.Semaphore(0)

    def send(ctx, deltas):  # what model.py builds for a response, without Triton
        t = time.perf_counter()
        arrays = [np.array([d.text.encode("utf-8") for d in deltas], dtype=np.object_),
                  np.array([len(d.token_ids) for d in deltas], dtype=np.uint32)]
        sent["build_s"] += time.perf_counter() - t
        sent["sends"] += 1
        sent["tokens"] += int(arrays[1].sum())
        if any(d.finished for d in deltas):
            done.release()

    def is_cancelled():
        polls[0] += 1
        busy_wait(1e-4)  # Triton's is_cancelled: ~0.1 ms through the stub's IPC
        return False

    streamer = ResponseStreamer(send)
    ae = AsyncEngine(engine, max_queue_size=num_seqs + 8)
    g = torch.Generator().manual_seed(num_seqs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    thread_t0 = {}
    for i in range(num_seqs):
        ids = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
        ae.submit(f"v{i}", ids, params, on_output=streamer.open(i, True), is_cancelled=is_cancelled)
    for _ in range(num_seqs):
        done.acquire(timeout=600)
    wall = time.perf_counter() - t0
    loop_cpu = ae.loop_thread_seconds() if hasattr(ae, "loop_thread_seconds") else None
    nsteps = ae.stats().steps
    ae.shutdown()
    streamer.close()
    del thread_t0
    res = {"num_seqs": num_seqs, "steps": nsteps, "wall_ms_per_step": wall / nsteps * 1e3,
           "engine_ms_per_step": step_timer.total / nsteps * 1e3, "cancel_polls_per_step": polls[0] / nsteps,
           "sends": sent["sends"], "tokens": sent["tokens"],
           "build_us_per_send": sent["build_s"] / max(1, sent["sends"]) * 1e6}
    res["serving_ms_per_step"] = res["wall_ms_per_step"] - res["engine_ms_per_step"]
    res.update(ae.timings() if hasattr(ae, "timings") else {})
    if loop_cpu is not None:
        res["loop_cpu_ms_per_step"] = loop_cpu / nsteps * 1e3
    return res


# ---- another checkout ---------------------------------------------------------------------------------------

def run_baseline(args) -> dict | None:
    base = Path(args.baseline).resolve()
    script = base / "scripts" / "bench_overhead.py"
    py = base / ".venv" / "bin" / "python"
    if not script.is_file():
        bc.progress(f"baseline: {script} does not exist; skipped")
        return None
    with tempfile.TemporaryDirectory(prefix="loom-overhead-base-") as out:
        cmd = [str(py if py.is_file() else sys.executable), str(script), "--seqs", *map(str, args.seqs),
               "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--prompt-len",
               str(args.prompt_len), "--vocab", str(args.vocab), "--out-dir", out, "--no-plot"]
        env = None
        if args.threads:
            import os
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        bc.progress("baseline: " + " ".join(cmd))
        p = subprocess.run(cmd, cwd=str(base), capture_output=True, text=True, env=env, timeout=3600)
        if p.returncode != 0:
            bc.progress(f"baseline failed ({p.returncode}):\n{p.stderr[-2000:]}")
            return None
        files = sorted(Path(out).glob("bench_overhead-*.json"))
        data = json.loads(files[-1].read_text())
    commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"dir": str(base), "commit": commit, "results": data["results"], "report": data.get("report", "")}


# ---- main --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data: dict = {"config": vars(args), "machine": bc.machine_info(), "torch_threads": torch.get_num_threads()}
    report: list[str] = []
    results = []
    with tempfile.TemporaryDirectory(prefix="loom-overhead-") as tmp:
        max_pos = args.prompt_len + max(max_new_tokens(n, args) for n in args.seqs + args.serving_seqs) + 64
        model_dir = make_tiny_model(str(Path(tmp) / "tiny-llama"), args.vocab, max(256, max_pos))
        bc.progress(f"stand-in model: tiny random Llama, vocab {args.vocab}, torch threads {torch.get_num_threads()}")
        for n in args.seqs:
            for path in args.paths:
                bc.progress(f"{n} running sequences, {path}: prefill, {args.warmup_steps} warm-up and {args.steps} "
                            "timed decode steps")
                r = measure(model_dir, n, args, path)
                results.append(r)
                bc.progress(f"  {n} {path}: {r['step_us']:.0f} us/step, host {r['host_us']:.0f} us")
        rows = [[r["num_seqs"], r["path"], r["step_us"], r["step_us_p99"]] + [r[f"{k}_us"] for k in PHASES]
                + [r["rest_us"], r["host_us"], r["schedule_us"] + r["prepare_us"]] for r in results]
        report.append(
            f"engine step with a no-op forward, decoding steady state (prompt {args.prompt_len} tokens, vocab "
            f"{args.vocab}, block {args.block_size}, device {args.device}, torch threads {torch.get_num_threads()}), "
            f"microseconds per step (mean over {args.steps} steps); host = step - sampler\n"
            + bc.table(["running seqs", "path", "step us", "p99 us", *PHASES, "rest", "host", "sched+prep"], rows, 1))
        data["results"] = results
        if args.sampler:
            srows = []
            data["sampler"] = []
            for n in args.seqs:
                bc.progress(f"sampler alone: {n} x {args.sampler_vocab}")
                s = measure_sampler(n, args)
                data["sampler"].append(s)
                srows.append([n] + [s[k] for k in ("torch_argmax_us", "argmax_us", "greedy_us", "greedy_x_argmax",
                                                   "greedy_logprobs_us", "random_us", "old_log_softmax_us",
                                                   "old_greedy_x_argmax")])
            report.append(f"the sampler alone, vocab {args.sampler_vocab}, microseconds per call (result on the host; "
                          "argmax: the op greedy sampling runs, torch.argmax beside it)\n"
                          + bc.table(["rows", "torch argmax", "argmax", "greedy", "x argmax", "greedy+logprobs",
                                      "random", "old: +log_softmax", "old x argmax"], srows, 2))
        if args.device_ms:
            orows = []
            data["overlap"] = []
            for n in args.seqs:
                bc.progress(f"fake device {args.device_ms:g} ms/step, {n} sequences: sync vs async scheduling")
                o = measure_overlap(model_dir, n, args)
                data["overlap"].append(o)
                orows.append([n, o["device_ms"], o["sync_ms"], o["async_ms"], o["sync_ms"] - o["device_ms"],
                              o["async_ms"] - o["device_ms"], o["same_tokens"]])
            report.append(f"a fake device taking {args.device_ms:g} ms per step: ms per step, synchronous vs async "
                          "scheduling (host work added to the device time)\n"
                          + bc.table(["running seqs", "device ms", "sync ms", "async ms", "sync added", "async added",
                                      "same tokens"], orows, 2))
        if args.serving:
            vrows = []
            data["serving"] = []
            for n in args.serving_seqs:
                bc.progress(f"serving side through AsyncEngine: {n} streaming requests")
                v = measure_serving(model_dir, n, args)
                data["serving"].append(v)
                vrows.append([n, v["steps"], v["engine_ms_per_step"], v["wall_ms_per_step"], v["serving_ms_per_step"],
                              v.get("loop_ms_per_step", float("nan")), v.get("detok_ms_per_step", float("nan")),
                              v.get("cancel_ms_per_sweep", float("nan")), v["cancel_polls_per_step"],
                              v["build_us_per_send"]])
            report.append("serving side through AsyncEngine (no-op forward, streaming outputs consumed, is_cancelled "
                          "costing 0.1 ms a call), ms per engine step\n"
                          + bc.table(["requests", "steps", "engine.step", "wall", "added", "loop extra", "detok",
                                      "cancel sweep", "polls/step", "build us/send"], vrows, 2))
    if args.baseline:
        base = run_baseline(args)
        if base is not None:
            data["baseline"] = base
            report.append(f"baseline: {base['dir']} at {base['commit']} (same sizes, its own script)\n"
                          + base["report"])
            by = {(r["num_seqs"], r.get("path", "persistent")): r for r in base["results"]}
            cmp_rows = []
            for r in results:
                b = by.get((r["num_seqs"], r["path"]))
                if r["path"] != "persistent" or b is None:
                    continue
                sp, bsp = r["schedule_us"] + r["prepare_us"], b["schedule_us"] + b["prepare_us"]
                cmp_rows.append([r["num_seqs"], b["step_us"], r["step_us"], bc.ratio(r["step_us"], b["step_us"]),
                                 b["host_us"], r["host_us"], bsp, sp, bc.ratio(sp, bsp)])
            report.append("us per step: baseline vs this tree (persistent path)\n"
                          + bc.table(["running seqs", "step base", "step this", "this / base", "host base",
                                      "host this", "sched+prep base", "sched+prep this", "this / base"], cmp_rows, 2))
    text = "\n\n".join(report)
    print(text, flush=True)
    data["report"] = text
    out = bc.out_dir(args.out_dir)
    name = f"bench_overhead-{bc.stamp()}{'-' + args.tag if args.tag else ''}"
    bc.save_json(data, out / f"{name}.json")
    if not args.no_plot and bc.have_matplotlib():
        plot(results, out / f"{name}.png")
    return 0


def plot(results: list[dict], path: Path) -> None:
    plt, fig, axes = bc.new_figure(1, 1, size=(8, 4.5))
    ax = axes[0][0]
    labels = [f"{r['num_seqs']}\n{r['path']}" for r in results]
    bottom = [0.0] * len(results)
    for key in (*PHASES, "rest"):
        vals = [max(0.0, r[f"{key}_us"]) for r in results]
        ax.bar(labels, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("running sequences, sampling path")
    ax.set_ylabel("microseconds per step")
    ax.set_title("engine host work per decode step (no-op forward)")
    ax.legend(fontsize=8)
    bc.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main())
