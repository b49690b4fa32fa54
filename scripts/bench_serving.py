#!/usr/bin/env python3
"""Serving benchmark: a load generator over Triton gRPC streaming, with the same load through the engine in
process (so the Triton layer's cost is a ratio), multi-LoRA, and NVIDIA's aiperf beside ours.

Requests speak vllm_backend's tensors: `text_input`, `stream`=true, `sampling_parameters` (JSON: max_tokens,
ignore_eos, temperature 0, lora_name), `exclude_input_in_output`=true, `return_num_output_tokens`=true.
Prompts are slices of ordinary English text (harness.bench.PROMPTS) of a drawn token length; each request
generates exactly its drawn number of tokens (EOS ignored).

Modes (`--mode`, default `sweep`; `all` runs sweep, rate and lora):
* sweep   fixed concurrency (--concurrency 1 4 16 64): a new request as soon as one finishes;
* rate    Poisson arrivals at --request-rate requests/s (optionally capped by --max-concurrency);
* lora    the same load (--lora-concurrency) with no adapter, one adapter, and every request on its own
          adapter (--num-adapters, tiny random PEFT adapters made in a temporary adapter root); ratios to
          no adapter. Every adapter is loaded by an untimed warm-up request first (load time reported);
* aiperf  installs aiperf 0.13.0 into .cache/aiperf-venv (once), runs it against Triton's HTTP
          generate_stream endpoint (template endpoint, tokenizer = the local default model folder) and runs
          our generator on the same load, tables side by side.

Measured per request: TTFT (send -> first token), inter-token latency (ITL: (e2e - ttft) / (tokens - 1)),
end-to-end latency; p50/p90/p99 of each and output tokens/s over the run. "offline" is the same requests
with the same arrival discipline submitted to an LLMEngine in this process (same config.pbtxt parameters),
stepped by this script, with incremental detokenization as the server does.

By default the script starts its own tritonserver (scripts/tritonserver_local.py) on a copy of
model_repository/loom_smollm2 whose adapter_roots points at the benchmark's adapters; --url uses a running one.

    python scripts/bench_serving.py                                  # concurrency sweep 1 4 16 64
    python scripts/bench_serving.py --mode rate --request-rate 1 2 4 --num-requests 64
    python scripts/bench_serving.py --mode lora --num-adapters 32
    python scripts/bench_serving.py --mode aiperf
    python scripts/bench_serving.py --concurrency 1 2 --num-requests 4 --input-len 16 --output-len 8   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness.bench as bc  # noqa: E402  (CPU tuning before torch)
from harness.aiperf import AIPERF_VERSION, aiperf_metric, run_aiperf
from harness.model_repo import copy_model, read_parameters
from harness.serving_load import Req, Result, arrival_times, make_workload, paired_rounds, round_line, summarize_run

MODEL_NAME = "loom_smollm2"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="sweep", choices=("sweep", "rate", "lora", "aiperf", "waterfall", "all"))
    ap.add_argument("--waterfall-concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                    help="waterfall mode: concurrency levels (TTFT at 1, 4, 16; tokens/s at 16, 64)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="sweep levels")
    ap.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="rate mode: requests/s")
    ap.add_argument("--max-concurrency", type=int, default=0, help="rate mode: cap on requests in flight (0 = none)")
    ap.add_argument("--num-requests", type=int, default=0,
                    help="requests per level (0 = auto: max(16, 4 x concurrency) in sweep, 64 in rate and lora)")
    ap.add_argument("--input-len", type=int, default=64, help="mean prompt tokens")
    ap.add_argument("--input-len-range", type=float, default=0.5,
                    help="prompt tokens uniform in [len*(1-r), len*(1+r)] (0 = fixed)")
    ap.add_argument("--output-len", type=int, default=64, help="mean output tokens (EOS ignored)")
    ap.add_argument("--output-len-range", type=float, default=0.5,
                    help="output tokens uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-requests", type=int, default=2, help="untimed requests before each system's runs")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sweep, rate, lora, waterfall: run each load this many times, Triton and in-process taking "
                         "turns to go first; tables pool the rounds and the median of the per-round ratios is "
                         "printed, with the TTFT added request by request (this machine's speed drifts by minutes: "
                         "only a pair run back to back compares)")
    ap.add_argument("--url", default=None, help="gRPC address of a running server (default: start one)")
    ap.add_argument("--timing-log", default=None,
                    help="waterfall mode with --url: the LOOM_TIMING_LOG file that server writes")
    ap.add_argument("--http-url", default=None, help="HTTP address of that server (aiperf mode)")
    ap.add_argument("--model", default=MODEL_NAME, help="Triton model name")
    ap.add_argument("--model-repository", default=str(bc.REPO_ROOT / "model_repository"),
                    help="repository holding the model folder "
                         "(copied; its adapter_roots is pointed at the bench adapters)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config.pbtxt parameter for this run (both server and offline), repeatable")
    ap.add_argument("--no-offline", action="store_true", help="skip the in-process engine comparison")
    ap.add_argument("--lora-concurrency", type=int, default=16)
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--adapter-rank", type=int, default=8)
    ap.add_argument("--adapter-root", default=None,
                    help="use these adapters (names = sub-folders) instead of making some")
    ap.add_argument("--aiperf-concurrency", type=int, default=4)
    ap.add_argument("--aiperf-requests", type=int, default=40)
    ap.add_argument("--aiperf-isl", type=int, default=64)
    ap.add_argument("--aiperf-osl", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


# ---- Triton gRPC load generator --------------------------------------------------------------------

class _Slot:
    """One gRPC client with its own stream; at most one request in flight on it, so errors map cleanly."""

    def __init__(self, url: str, on_event):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.current: Result | None = None
        self.client.start_stream(callback=lambda result=None, error=None: on_event(self, result, error))

    def close(self):
        try:
            self.client.stop_stream()
            self.client.close()
        except Exception:
            pass


def _inputs(req: Req, ignore_eos: bool = True):
    import numpy as np
    import tritonclient.grpc as grpcclient

    def t(name, value, dtype):
        arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
        x = grpcclient.InferInput(name, [1], dtype)
        x.set_data_from_numpy(arr)
        return x

    sp = {"max_tokens": req.max_tokens, "ignore_eos": ignore_eos, "temperature": 0}
    if req.lora:
        sp["lora_name"] = req.lora
    return [t("text_input", req.text.encode(), "BYTES"), t("stream", True, "BOOL"),
            t("sampling_parameters", json.dumps(sp).encode(), "BYTES"),
            t("exclude_input_in_output", True, "BOOL"), t("return_num_output_tokens", True, "BOOL")]


def run_triton(url: str, model: str, reqs: list[Req], concurrency: int | None, rate: float | None, seed: int,
               timeout: float, label: str) -> list[Result]:
    """Send `reqs` with at most `concurrency` in flight (None = unbounded) at the given arrival times."""
    n = len(reqs)
    arrivals = arrival_times(n, rate, seed)
    results = [Result(i) for i in range(n)]
    done = threading.Semaphore(0)
    free: queue.Queue = queue.Queue()
    slots: list[_Slot] = []
    lock = threading.Lock()

    def on_event(slot: _Slot, result, error):
        now = time.perf_counter()
        r = slot.current
        if r is None:
            return
        final = False
        if error is not None:
            r.error = str(error.message() if hasattr(error, "message") else error)
            final = True
        else:
            resp = result.get_response()
            if resp.outputs:
                try:
                    k = int(result.as_numpy("num_output_tokens")[0])
                except Exception:
                    k = 1
                if k:
                    if not r.chunks:
                        r.t_first_mono = time.monotonic()
                    r.chunks.append((now, k))
            p = resp.parameters.get("triton_final_response")
            final = p is not None and p.bool_param
        if final:
            r.t_end = now
            slot.current = None
            free.put(slot)
            done.release()

    def get_slot() -> _Slot:
        try:
            return free.get_nowait()
        except queue.Empty:
            pass
        with lock:
            if concurrency is None or len(slots) < concurrency:
                s = _Slot(url, on_event)
                slots.append(s)
                return s
        return free.get()

    # concurrency mode: open the streams up front so connection set-up is not timed
    if concurrency is not None and rate is None:
        for _ in range(min(concurrency, n)):
            s = _Slot(url, on_event)
            slots.append(s)
            free.put(s)
    t0 = time.perf_counter()
    last = t0
    try:
        for i, req in enumerate(reqs):
            wait = t0 + arrivals[i] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            slot = get_slot()
            r = results[i]
            slot.current = r
            r.t_send = time.perf_counter()
            r.t_send_mono = time.monotonic()
            try:
                slot.client.async_stream_infer(model, _inputs(req), request_id=f"{label}/{i}",
                                               enable_empty_final_response=True)
            except Exception as e:
                r.error, r.t_end, slot.current = f"send failed: {e}", time.perf_counter(), None
                free.put(slot)
                done.release()
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                bc.progress(f"    {label}: {i + 1}/{n} sent")
        deadline = time.perf_counter() + timeout
        for k in range(n):
            if not done.acquire(timeout=max(0.0, deadline - time.perf_counter())):
                raise TimeoutError(f"{label}: {n - k} requests still running after {timeout:.0f}s")
    finally:
        for s in slots:
            s.close()
    return results


# ---- the same load through the engine in this process --------------------------------------------------

class OfflineRunner:
    def __init__(self, engine_config):
        from loom.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(engine_config)
        self.tok = self.engine.tokenizer
        self._n = 0

    def run(self, reqs: list[Req], concurrency: int | None, rate: float | None, seed: int, label: str) -> list[Result]:
        from loom.engine.detokenizer import IncrementalDetokenizer
        from loom.engine.sampling_params import SamplingParams

        eng = self.engine
        n = len(reqs)
        arrivals = arrival_times(n, rate, seed)
        results = [Result(i) for i in range(n)]
        live: dict[str, tuple[Result, object]] = {}
        nxt = 0
        finished = 0
        t0 = time.perf_counter()
        last = t0
        while finished < n:
            now = time.perf_counter()
            while nxt < n and t0 + arrivals[nxt] <= now and (concurrency is None or len(live) < concurrency):
                req = reqs[nxt]
                rid = f"bench-{self._n}"
                self._n += 1
                ids = self.tok.encode(req.text, add_special_tokens=False)  # as the server does
                params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
                r = results[nxt]
                r.t_send = time.perf_counter()
                r.t_send_mono = time.monotonic()
                try:
                    eng.add_request(rid, ids, params, req.lora)
                    live[rid] = (r, IncrementalDetokenizer(self.tok, ids, params))
                except Exception as e:
                    r.error, r.t_end = str(e), time.perf_counter()
                    finished += 1
                nxt += 1
            if not live:
                if nxt < n:
                    time.sleep(max(0.0, t0 + arrivals[nxt] - time.perf_counter()))
                continue
            outs = eng.step()
            now = time.perf_counter()
            for so in outs:
                entry = live.get(so.request_id)
                if entry is None:
                    continue
                r, detok = entry
                if so.new_token_ids:
                    if so.timing is not None:  # its first token: the engine's stages (waterfall)
                        r.t_first_mono = time.monotonic()
                        r.stages = {"first_scheduled": so.timing[0], "first_token": so.timing[1]}
                    detok.step(so.new_token_ids, so.finished)
                    r.chunks.append((now, len(so.new_token_ids)))
                if so.finished:
                    if so.error:
                        r.error = so.error
                    r.t_end = now
                    del live[so.request_id]
                    finished += 1
            if now - last > 10:
                last = now
                bc.progress(f"    {label}: {finished}/{n} done")
        return results


# ---- the engine configuration of the served model ----------------------------------------------------------

def engine_config_from(params: dict[str, str], model_dir: Path):
    from loom.serving.serve_config import parse_model_parameters

    cfg = parse_model_parameters({k: {"string_value": v} for k, v in params.items()}, str(model_dir))
    if not cfg.engine.model:
        cfg.engine.model = bc.default_model_dir()
    return cfg.engine


# ---- reporting ------------------------------------------------------------------------------------

def run_rows(label: str, s: dict) -> list:
    return [label, s["ok"], s["errors"], s["output_tok_s"],
            s["ttft_s"]["p50"] * 1e3, s["ttft_s"]["p90"] * 1e3, s["ttft_s"]["p99"] * 1e3,
            s["itl_s"]["p50"] * 1e3, s["itl_s"]["p90"] * 1e3, s["itl_s"]["p99"] * 1e3,
            s["e2e_s"]["p50"], s["e2e_s"]["p90"], s["e2e_s"]["p99"]]


RUN_HEADERS = ["run", "ok", "err", "out tok/s", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99",
               "E2E p50 s", "p90", "p99"]


def ratio_row(label: str, a: dict, b: dict) -> list:
    """a / b for throughput and the p50/p99 latencies."""
    return [label, bc.ratio(a["output_tok_s"], b["output_tok_s"]),
            bc.ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]), bc.ratio(a["ttft_s"]["p99"], b["ttft_s"]["p99"]),
            bc.ratio(a["itl_s"]["p50"], b["itl_s"]["p50"]), bc.ratio(a["itl_s"]["p99"], b["itl_s"]["p99"]),
            bc.ratio(a["e2e_s"]["p50"], b["e2e_s"]["p50"]), bc.ratio(a["e2e_s"]["p99"], b["e2e_s"]["p99"])]


RATIO_HEADERS = ["", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99"]


# ---- TTFT waterfall --------------------------------------------------------------------------------

# (stage, from, to): timestamps of a request, time.monotonic() in the client and the server (one machine)
TRITON_STAGES = [("client -> execute()", "send", "arrival"), ("read + parse inputs", "arrival", "parsed"),
                 ("tokenize", "parsed", "tokenized"),
                 ("submit", "tokenized", "submitted"), ("queue -> scheduled", "submitted", "first_scheduled"),
                 ("scheduled -> token", "first_scheduled", "first_token"), ("detokenize", "first_token", "emitted"),
                 ("emitted -> sent", "emitted", "first_sent"), ("sent -> client", "first_sent", "received")]
OFFLINE_STAGES = [("queue -> scheduled", "send", "first_scheduled"),
                  ("scheduled -> token", "first_scheduled", "first_token"),
                  ("token -> caller", "first_token", "received")]


def timing_log_path(args, work: Path) -> Path:
    return Path(args.timing_log) if args.timing_log else work / "timing.jsonl"


def read_timing_log(path: Path) -> dict[str, dict]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec.get("id", "")] = rec
    return out


def request_stages(r: Result, stages: list) -> dict[str, float] | None:
    """Milliseconds per stage of one request's time to first token (None if a timestamp is missing)."""
    if r.error is not None or not r.chunks or r.stages is None:
        return None
    t = {**r.stages, "send": r.t_send_mono, "received": r.t_first_mono}
    if any(t.get(a) is None or t.get(b) is None for _, a, b in stages):
        return None
    out = {name: (t[b] - t[a]) * 1e3 for name, a, b in stages}
    out["TTFT"] = (r.t_first_mono - r.t_send_mono) * 1e3
    return out


def waterfall_rows(results: list[Result], stages: list) -> dict[str, float]:
    per = [x for x in (request_stages(r, stages) for r in results) if x is not None]
    if not per:
        return {}
    return {k: bc.percentile([p[k] for p in per], 50) for k in per[0]} | {"n": len(per)}


def run_waterfall(args, tok, url: str, offline, warm, work: Path, data: dict) -> str:
    """At each concurrency: the same requests through Triton and in-process; p50 of each stage of TTFT."""
    log_path = timing_log_path(args, work)
    cols, entries = [], {}
    for c in args.waterfall_concurrency:
        n = args.num_requests or max(16, 4 * c)
        reqs = make_workload(tok, n, args.input_len, args.input_len_range, args.output_len, args.output_len_range,
                             args.seed + 4000 + c)
        if not entries:
            warm(reqs)

        def triton(k: int, c=c, reqs=reqs) -> list[Result]:
            label = f"wf{c}.{k}"
            bc.progress(f"  waterfall c={c}: triton ({n} requests, round {k + 1})")
            tri = run_triton(url, args.model, reqs, c, None, args.seed, args.request_timeout, label)
            server = read_timing_log(log_path)
            for i, r in enumerate(tri):
                r.stages = server.get(f"{label}/{i}")
            return tri

        def in_process(k: int, c=c, reqs=reqs) -> list[Result]:
            bc.progress(f"  waterfall c={c}: in-process ({n} requests, round {k + 1})")
            return offline.run(reqs, c, None, args.seed, f"wf{c}.{k}")

        tri, off, per_round = paired_rounds(args.rounds, triton, in_process if offline is not None else None, reqs)
        e = {"triton": waterfall_rows(tri, TRITON_STAGES), "triton_run": summarize_run(tri, reqs)}
        if off is not None:
            e["offline"] = waterfall_rows(off, OFFLINE_STAGES)
            e["offline_run"] = summarize_run(off, reqs)
        if per_round is not None:
            e["per_round"] = per_round
        entries[c] = e
        cols.append(c)
    data["runs"]["waterfall"] = entries
    names = [s[0] for s in TRITON_STAGES] + ["TTFT"]
    headers = ["stage (p50 ms)"] + [f"c={c} {sys_}" for c in cols for sys_ in ("triton", "in-proc")]
    rows = []
    for name in names:
        row = [name]
        for c in cols:
            row += [entries[c]["triton"].get(name, float("nan")),
                    entries[c].get("offline", {}).get(name, float("nan"))]
        rows.append(row)
    summary = []
    for c in cols:
        t, o = entries[c]["triton_run"], entries[c].get("offline_run")
        line = f"c={c}: TTFT p50 triton {t['ttft_s']['p50'] * 1e3:.1f} ms"
        if o is not None:
            added = (t["ttft_s"]["p50"] - o["ttft_s"]["p50"]) * 1e3
            line += (f", in-process {o['ttft_s']['p50'] * 1e3:.1f} ms (added {added:+.1f} ms); output tok/s "
                     f"triton / in-process {bc.ratio(t['output_tok_s'], o['output_tok_s']):.2f}")
        summary.append(line)
        if "per_round" in entries[c]:
            summary.append(round_line(f"c={c}", entries[c]["per_round"]))
    return (f"TTFT waterfall (p50 per stage, ms; in-process stages: queue -> scheduled from add_request), "
            f"prompt ~{args.input_len} tokens, output ~{args.output_len}\n" + bc.table(headers, rows, 1) + "\n"
            + "\n".join(summary))


# ---- main -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = bc.default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    modes = ["sweep", "rate", "lora"] if args.mode == "all" else [args.mode]
    data: dict = {"config": vars(args), "machine": bc.machine_info(), "runs": {}}
    report: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="loom-bench-serving-"))
    server = None
    offline = None
    try:
        # adapters (only the lora mode sends lora_name; the root is configured either way)
        adapter_names: list[str] = []
        if args.adapter_root:
            adapter_root = Path(args.adapter_root).resolve()
            adapter_names = sorted(p.name for p in adapter_root.iterdir() if (p / "adapter_config.json").is_file())
        else:
            adapter_root = work / "adapters"
            adapter_root.mkdir()
            if "lora" in modes:
                from harness.lora import make_bench_adapters

                bc.progress(f"making {args.num_adapters} random rank-{args.adapter_rank} adapters in {adapter_root}")
                adapter_names = make_bench_adapters(model_dir, adapter_root, args.num_adapters, args.adapter_rank,
                                                    args.seed)
        overrides = {"adapter_roots": str(adapter_root)}
        for kv in args.set:
            k, _, v = kv.partition("=")
            overrides[k.strip()] = v.strip()
        repo = work / "model_repository"  # a copy of the model folder, its adapters included
        served = copy_model(repo, overrides, src_repo=Path(args.model_repository), model=args.model, keep_adapters=True)
        params = read_parameters((served / "config.pbtxt").read_text())
        data["server_parameters"] = params
        url, http_url = args.url, args.http_url
        if url is None:
            from harness.tritonserver import LocalTritonServer

            bc.progress("starting tritonserver (tritonserver_local.py)")
            server = LocalTritonServer()
            env = {**os.environ, "LOOM_TIMING_LOG": str(timing_log_path(args, work))} if "waterfall" in modes else None
            server.start(repo, timeout=600, env=env)
            url, http_url = server.grpc_url, server.http_url
            bc.progress(f"server ready: gRPC {url}, HTTP {http_url}")
        if not args.no_offline and args.mode != "aiperf":
            bc.progress("offline engine: loading (same parameters as the server)")
            offline = OfflineRunner(engine_config_from(params, repo / args.model))

        def warm(label_reqs: list[Req]):
            if args.warmup_requests:
                w = label_reqs[:args.warmup_requests]
                run_triton(url, args.model, w, len(w), None, args.seed, args.request_timeout, "warm-up")
                if offline is not None:
                    offline.run(w, len(w), None, args.seed, "warm-up")

        def one(label: str, reqs: list[Req], conc: int | None, rate: float | None) -> dict:
            def triton(k: int) -> list[Result]:
                bc.progress(f"  {label}: triton ({len(reqs)} requests, round {k + 1})")
                return run_triton(url, args.model, reqs, conc, rate, args.seed, args.request_timeout, f"{label}.{k}")

            def in_process(k: int) -> list[Result]:
                bc.progress(f"  {label}: offline engine (round {k + 1})")
                return offline.run(reqs, conc, rate, args.seed, label)

            tri_res, off_res, per_round = paired_rounds(args.rounds, triton,
                                                        in_process if offline is not None else None, reqs)
            tri = summarize_run(tri_res, reqs)
            entry = {"triton": tri, "num_requests": len(reqs), "concurrency": conc, "rate": rate,
                     "prompt_tokens_mean": sum(r.prompt_len for r in reqs) / len(reqs),
                     "output_tokens_mean": sum(r.max_tokens for r in reqs) / len(reqs)}
            msg = f"  {label}: triton {tri['output_tok_s']:.1f} tok/s, TTFT p50 {tri['ttft_s']['p50'] * 1e3:.0f} ms"
            if off_res is not None:
                off = summarize_run(off_res, reqs)
                entry["offline"] = off
                msg += f"; offline {off['output_tok_s']:.1f} tok/s, TTFT p50 {off['ttft_s']['p50'] * 1e3:.0f} ms"
            if per_round is not None:
                entry["per_round"] = per_round
            if tri["errors"]:
                msg += f"; {tri['errors']} triton errors, e.g. {tri['first_error']}"
            bc.progress(msg)
            return entry

        def table_for(title: str, entries: dict[str, dict], base_key: str | None = None) -> str:
            rows, ratios = [], []
            for label, e in entries.items():
                rows.append(run_rows(f"{label} triton", e["triton"]))
                if "offline" in e:
                    rows.append(run_rows(f"{label} offline", e["offline"]))
                    ratios.append(ratio_row(f"{label}: triton / offline", e["triton"], e["offline"]))
                if base_key is not None and label != base_key:
                    ratios.append(ratio_row(f"{label} / {base_key} (triton)", e["triton"], entries[base_key]["triton"]))
            text = title + "\n" + bc.table(RUN_HEADERS, rows, 1)
            if ratios:
                text += "\n\nratios\n" + bc.table(RATIO_HEADERS, ratios, 2)
            rounds = [round_line(label, e["per_round"]) for label, e in entries.items() if "per_round" in e]
            if rounds:
                text += "\n" + "\n".join(rounds)
            return text

        lens = (f"prompt ~{args.input_len} tokens (range {args.input_len_range}), "
                f"output ~{args.output_len} (range {args.output_len_range})")
        if "sweep" in modes:
            bc.progress("sweep: " + ", ".join(f"c={c}" for c in args.concurrency))
            entries = {}
            for c in args.concurrency:
                n = args.num_requests or max(16, 4 * c)
                reqs = make_workload(tok, n, args.input_len, args.input_len_range, args.output_len,
                                     args.output_len_range, args.seed + c)
                if not entries:
                    warm(reqs)
                entries[f"c={c}"] = one(f"c={c}", reqs, c, None)
            data["runs"]["sweep"] = entries
            report.append(table_for(f"concurrency sweep, {lens}", entries))
        if "rate" in modes:
            entries = {}
            cap = args.max_concurrency or None
            for rate in args.request_rate:
                n = args.num_requests or 64
                reqs = make_workload(tok, n, args.input_len, args.input_len_range, args.output_len,
                                     args.output_len_range, args.seed + 1000)
                if not entries and "sweep" not in modes:
                    warm(reqs)
                entries[f"{rate:g} req/s"] = one(f"{rate:g} req/s", reqs, cap, rate)
            data["runs"]["rate"] = entries
            report.append(table_for(f"Poisson arrivals{f', at most {cap} in flight' if cap else ''}, {lens}", entries))
        if "lora" in modes:
            if not adapter_names:
                raise RuntimeError("lora mode: no adapters (none made and none found under --adapter-root)")
            n = args.num_requests or 64
            c = args.lora_concurrency
            base = make_workload(tok, n, args.input_len, args.input_len_range, args.output_len,
                                 args.output_len_range, args.seed + 2000)
            if "sweep" not in modes and "rate" not in modes:
                warm(base)
            # load every adapter once (untimed for the load test; its time is reported)
            bc.progress(f"lora: loading {len(adapter_names)} adapters (one short request each)")
            loads = [Req(base[0].text, base[0].prompt_len, 2, a) for a in adapter_names]
            t = time.perf_counter()
            s = summarize_run(run_triton(url, args.model, loads, min(8, len(loads)), None, args.seed,
                                         args.request_timeout, "adapter load"), loads)
            load_s = time.perf_counter() - t
            if s["errors"]:
                raise RuntimeError(f"adapter load failed: {s['first_error']}")
            if offline is not None:
                offline.run(loads, min(8, len(loads)), None, args.seed, "adapter load")
            variants = {
                "no adapter": [Req(r.text, r.prompt_len, r.max_tokens, None) for r in base],
                "one adapter": [Req(r.text, r.prompt_len, r.max_tokens, adapter_names[0]) for r in base],
                f"{len(adapter_names)} adapters": [Req(r.text, r.prompt_len, r.max_tokens,
                                                       adapter_names[i % len(adapter_names)])
                                                   for i, r in enumerate(base)],
            }
            entries = {label: one(label, reqs, c, None) for label, reqs in variants.items()}
            data["runs"]["lora"] = {"adapter_load_s": load_s, "num_adapters": len(adapter_names),
                                    "rank": args.adapter_rank, "concurrency": c, "entries": entries}
            report.append(table_for(f"multi-LoRA at concurrency {c}, {n} requests, "
                                    f"rank {args.adapter_rank} q/v adapters "
                                    f"(loading all {len(adapter_names)} took {load_s:.1f}s, untimed), {lens}",
                                    entries, base_key="no adapter"))
        if "waterfall" in modes:
            report.append(run_waterfall(args, tok, url, offline, warm, work, data))
        if "aiperf" in modes:
            if http_url is None:
                raise RuntimeError("aiperf mode needs the server's HTTP address (--http-url)")
            res = run_aiperf(http_url, args.model, model_dir, args, work)
            # our generator on the same load: fixed lengths, same concurrency and count
            reqs = make_workload(tok, args.aiperf_requests, args.aiperf_isl, 0.0, args.aiperf_osl, 0.0,
                                 args.seed + 3000)
            warm(reqs)
            ours = summarize_run(run_triton(url, args.model, reqs, args.aiperf_concurrency, None, args.seed,
                                            args.request_timeout, "ours"), reqs)
            ex = res["export"]
            rows = []
            for metric, key, scale, ours_val in (
                    ("TTFT p50 ms", "time_to_first_token", 1, ours["ttft_s"]["p50"] * 1e3),
                    ("TTFT p99 ms", "time_to_first_token", 1, ours["ttft_s"]["p99"] * 1e3),
                    ("ITL p50 ms", "inter_token_latency", 1, ours["itl_s"]["p50"] * 1e3),
                    ("ITL p99 ms", "inter_token_latency", 1, ours["itl_s"]["p99"] * 1e3),
                    ("E2E p50 ms", "request_latency", 1, ours["e2e_s"]["p50"] * 1e3),
                    ("E2E p99 ms", "request_latency", 1, ours["e2e_s"]["p99"] * 1e3),
                    ("output tok/s", "output_token_throughput", 1, ours["output_tok_s"]),
                    ("requests/s", "request_throughput", 1, ours["req_s"])):
                stat = "avg" if "/s" in metric else metric.split()[1]
                theirs = aiperf_metric(ex, key, stat)
                rows.append([metric, theirs, ours_val, f"{bc.ratio(ours_val, theirs):.2f}"])
            data["runs"]["aiperf"] = {"aiperf": res, "ours": ours}
            report.append(f"aiperf {AIPERF_VERSION} vs this script, concurrency {args.aiperf_concurrency}, "
                          f"{args.aiperf_requests} requests, isl {args.aiperf_isl}, osl {args.aiperf_osl} "
                          "(HTTP vs gRPC)\n"
                          + (res["console_table"] + "\n\n" if res["console_table"] else "")
                          + bc.table(["metric", "aiperf", "ours", "ours / aiperf"], rows, 1))
    finally:
        if server is not None:
            bc.progress("stopping tritonserver")
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    text = "\n\n".join(report)
    print(text, flush=True)
    data["report"] = text
    bc.save_results(data, f"bench_serving-{args.mode}", args, plot)
    return 0


def plot(data: dict, path: Path) -> None:
    runs = {k: v for k, v in data["runs"].items() if k in ("sweep", "rate", "lora")}
    if not runs or not bc.have_matplotlib():
        return
    plt, fig, axes = bc.new_figure(1, len(runs), size=(6 * len(runs), 4.5))
    for ax, (mode, entries) in zip(axes[0], runs.items()):
        if mode == "lora":
            entries = entries["entries"]
        labels = list(entries)
        x = range(len(labels))
        for sysname, style in (("triton", "-o"), ("offline", "--s")):
            if all(sysname in entries[k] for k in labels):
                ax.plot(x, [entries[k][sysname]["output_tok_s"] for k in labels], style, label=f"{sysname} tok/s")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("output tokens/s")
        ax2 = ax.twinx()
        for sysname, style in (("triton", ":o"), ("offline", ":s")):
            if all(sysname in entries[k] for k in labels):
                ax2.plot(x, [entries[k][sysname]["ttft_s"]["p50"] * 1e3 for k in labels], style, alpha=0.6,
                         label=f"{sysname} TTFT p50")
        ax2.set_ylabel("TTFT p50 (ms)")
        ax.set_title(mode)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8)
    bc.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main())
