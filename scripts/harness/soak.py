"""The soak of scripts/soak.py (that script's docstring says what it does): streaming workers with cancellations and
bad input, an adapter churner, then the counts and every invariant in a `SoakReport`. The script starts the server;
tests/reliability/test_soak_ci.py runs the short version on the reliability tests' server."""
from __future__ import annotations

import collections
import json
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.triton_client import make_inputs, metric, scrape, tensor

MODEL = "loom_smollm2"
CHURN = "churn"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "In 1969, astronauts", "Water boils at", "My favourite colour is", "The quick brown fox",
           "Write a haiku about the sea.", "List three prime numbers:", "Q: What is 2+2?\nA:", "Dear diary,"]
CANCELLED_MSG = "cancelled"


# ------------------------------------------------------------------ requests

@dataclass
class BadInput:
    kind: str
    expect: str  # the error message must start with this (the field)
    engine: bool  # refused by the engine (counted by loom_request_finished_total{reason="rejected"}), else at parse
    prompt: str | None = "Hello"
    params: dict | None = None
    sp_raw: str | None = None
    input_ids: list | None = None


BAD_INPUTS = [
    BadInput("unknown_param", "bogus:", False, params={"bogus": 1}),
    BadInput("negative_max_tokens", "max_tokens:", False, params={"max_tokens": -1}),
    BadInput("bad_json", "sampling_parameters:", False, sp_raw="{not json"),
    BadInput("too_many_logprobs", "logprobs:", False, params={"logprobs": 1000}),
    BadInput("empty_prompt", "text_input:", False, prompt=""),
    BadInput("oversized_json", "sampling_parameters:", False, params={"stop": ["x" * 200] * 400}),
    BadInput("too_many_stops", "stop:", False, params={"stop": ["x"] * 50}),
    BadInput("text_and_ids", "input_ids:", False, input_ids=[1, 2, 3]),
    BadInput("token_id_out_of_vocab", "input_ids:", False, prompt=None, input_ids=[10 ** 7]),
    BadInput("lora_dotdot", "lora_name:", True, params={"lora_name": "../x"}),
    BadInput("lora_absolute", "lora_name:", True, params={"lora_name": "/etc"}),
    BadInput("unknown_adapter", "lora_name:", True, params={"lora_name": "no-such-adapter"}),
]


@dataclass
class Rec:
    rid: str
    kind: str  # gen | bad:<kind>
    prompt: str = ""
    lora: str | None = None
    stream: bool = True
    cancel_at: int = 0  # cancel once this many tokens arrived (0: never)
    cancel_by_close: bool = False
    expect: str = ""
    engine_level: bool = True
    text: str = ""
    tokens: int = 0
    responses: int = 0
    status: str = "pending"  # ok | error | cancelled | lost
    error: str | None = None
    finish_reason: str | None = None
    extra: int = 0  # responses after the final one (answered twice)
    cancel_requested: bool = False
    cancel_late: bool = False  # the cancel was requested but the final response came first
    done: threading.Event = field(default_factory=threading.Event, repr=False)


# ------------------------------------------------------------------ workers

class Worker(threading.Thread):
    """One gRPC client and stream; one request in flight at a time (so an error, which carries no request
    id, belongs to the request in flight)."""

    def __init__(self, idx: int, cfg: "SoakConfig", deadline: float, seed: int, out: list, stray: collections.Counter):
        super().__init__(name=f"soak-{idx}", daemon=True)
        self.idx, self.cfg, self.deadline = idx, cfg, deadline
        self.rng = random.Random(seed)
        self.out, self.stray = out, stray
        self.lock = threading.Lock()
        self.cur: Rec | None = None
        self.recs: dict[str, Rec] = {}
        self.client = None
        self.n = 0
        self.wake = threading.Event()

    # -- stream
    def _open(self):
        import tritonclient.grpc as grpcclient

        if self.client is None:
            self.client = grpcclient.InferenceServerClient(self.cfg.url)
        self.client.start_stream(callback=self._cb)

    def _close(self, cancel: bool, drop_client: bool = False):
        try:
            self.client.stop_stream(cancel_requests=cancel)
        except Exception:
            pass
        if drop_client:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None

    def _cb(self, result=None, error=None):
        with self.lock:
            if result is not None:
                resp = result.get_response()
                rec = self.recs.get(resp.id)
                if rec is None:
                    self.stray["response for an unknown request id"] += 1
                    return
                if rec.done.is_set():
                    rec.extra += 1
                    return
                final = resp.parameters.get("triton_final_response")
                is_final = final is not None and final.bool_param
                if resp.outputs:
                    rec.responses += 1
                    rec.text += result.as_numpy("text_output")[0].decode()
                    n = result.as_numpy("num_output_tokens")
                    rec.tokens += int(n.sum()) if n is not None else 0
                    fr = result.as_numpy("finish_reason")
                    if fr is not None:
                        rec.finish_reason = fr[0].decode()
                if is_final:
                    rec.status = "ok"
                    rec.cancel_late = rec.cancel_requested
                    rec.done.set()
                elif rec.cancel_at and rec.tokens >= rec.cancel_at and not rec.cancel_requested:
                    self.wake.set()  # the worker cancels (stop_stream from this thread would join itself)
                return
            msg = str(error)
            rec = self.cur
            if rec is None or rec.done.is_set():
                if rec is not None and rec.cancel_requested and "ancelled" in msg:
                    return  # our own cancel, after the request was already done
                if rec is not None and rec.status == "lost":
                    return
                self.stray[f"error with no request in flight: {msg[:120]}"] += 1
                if rec is not None:
                    rec.extra += 1
                return
            if rec.cancel_requested and "ancelled" in msg:
                rec.status = "cancelled"
            else:
                rec.status, rec.error = "error", msg
            rec.done.set()

    # -- requests
    def _next(self) -> tuple[Rec, list, dict | None]:
        cfg, rng = self.cfg, self.rng
        self.n += 1
        rid = f"w{self.idx}-{self.n}"
        if rng.random() < cfg.bad_fraction:
            b = rng.choice(BAD_INPUTS)
            rec = Rec(rid, "bad:" + b.kind, expect=b.expect, engine_level=b.engine)
            return rec, make_inputs(b.prompt, b.params, sp_raw=b.sp_raw, input_ids=b.input_ids), None
        prompt = rng.choice(PROMPTS)
        lora = rng.choice([None] + list(cfg.adapters) + ([CHURN] if cfg.churn else []))
        stream = rng.random() >= cfg.non_stream_fraction
        rec = Rec(rid, "gen", prompt=prompt, lora=lora, stream=stream)
        if stream and rng.random() < cfg.cancel_fraction:
            rec.cancel_at = rng.randint(1, max(1, cfg.max_tokens // 2))
            rec.cancel_by_close = rng.random() < 0.5
        params = {"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True}
        if lora:
            params["lora_name"] = lora
        flags = dict(return_num_output_tokens=True, return_finish_reason=True)
        if not stream:
            flags["exclude_input_in_output"] = True
        return rec, make_inputs(prompt, params, stream=stream, **flags), None

    def run(self):
        try:
            self._open()
            while time.monotonic() < self.deadline:
                rec, inputs, params = self._next()
                with self.lock:
                    self.recs[rec.rid] = rec
                    self.cur = rec
                self.out.append(rec)
                self.wake.clear()
                try:
                    self.client.async_stream_infer(MODEL, inputs, request_id=rec.rid, parameters=params,
                                                   enable_empty_final_response=True)
                except Exception as e:  # the stream broke: count it, start a fresh one
                    with self.lock:
                        rec.status, rec.error = "error", f"client: {e}"
                        rec.done.set()
                    self._close(cancel=True, drop_client=True)
                    self._open()
                    continue
                give_up = time.monotonic() + self.cfg.request_timeout_s
                while not rec.done.is_set():
                    self.wake.wait(0.05)
                    if self.wake.is_set() and not rec.done.is_set() and not rec.cancel_requested:
                        self.wake.clear()
                        with self.lock:
                            rec.cancel_requested = True
                        self._close(cancel=True, drop_client=rec.cancel_by_close)
                        rec.done.wait(5.0)  # the CANCELLED callback arrives when the stream's thread ends
                        with self.lock:
                            if not rec.done.is_set():
                                rec.status = "cancelled"
                                rec.done.set()
                        self._open()
                    if time.monotonic() > give_up and not rec.done.is_set():
                        with self.lock:
                            rec.status = "lost"
                            rec.done.set()
                        self._close(cancel=True, drop_client=True)
                        self._open()
        except Exception as e:  # noqa: BLE001 - report, the soak goes on with the other workers
            self.stray[f"worker crashed: {type(e).__name__}: {e}"] += 1
        finally:
            if self.client is not None:
                self._close(cancel=False, drop_client=True)


class Churner(threading.Thread):
    """Adapter management through `adapter_op` requests while the workers stream."""

    def __init__(self, cfg: "SoakConfig", deadline: float, adapter_root: Path):
        super().__init__(name="soak-churn", daemon=True)
        self.cfg, self.deadline, self.root = cfg, deadline, adapter_root
        self.results: collections.Counter = collections.Counter()
        self.log: list[tuple[float, str, str, str]] = []

    def op(self, client, op: str, name: str | None = None, path: str | None = None, timeout: float = 120.0):
        import tritonclient.grpc as grpcclient  # noqa: F401

        done = threading.Event()
        box: dict = {}

        def cb(result=None, error=None):
            if "r" not in box:
                box["r"] = (result, error)
            done.set()

        client.start_stream(callback=cb)
        try:
            params = {"adapter_op": op}
            if name:
                params["lora_name"] = name
            if path:
                params["lora_path"] = path
            client.async_stream_infer(MODEL, [tensor("text_input", [b""], "BYTES")], parameters=params,
                                      request_id=f"op-{op}-{name}-{time.monotonic_ns()}")
            if not done.wait(timeout):
                return None, "timeout"
            result, error = box["r"]
            if error is not None:
                return None, str(error)
            return json.loads(result.as_numpy("text_output")[0].decode()), None
        finally:
            client.stop_stream(cancel_requests=False)

    def run(self):
        import tritonclient.grpc as grpcclient

        a = self.cfg.adapters
        plan = []
        if a:
            first, second = str(self.root / a[0]), str(self.root / a[-1])
            plan = [("load", CHURN, first), ("reload", a[0], None), ("reload", CHURN, second),
                    ("unload", a[-1], None), ("reload", CHURN, first), ("list", None, None), ("unload", CHURN, None),
                    ("info", None, None)]
        client = grpcclient.InferenceServerClient(self.cfg.url)
        try:
            i = 0
            while plan and time.monotonic() < self.deadline:
                op, name, path = plan[i % len(plan)]
                i += 1
                res, err = self.op(client, op, name, path)
                key = f"{op} ok" if err is None else f"{op} error: {re.sub(r'[0-9]+', 'N', err)[:100]}"
                self.results[key] += 1
                self.log.append((time.monotonic(), op, name or "", "ok" if err is None else err))
                time.sleep(self.cfg.churn_interval_s)
            # leave the churned name loaded or not: either is fine for the invariants
        finally:
            client.close()


# ------------------------------------------------------------------ the soak

@dataclass
class SoakConfig:
    url: str = ""
    metrics_url: str = ""
    duration_s: float = 60.0
    streams: int = 200
    cancel_fraction: float = 0.5
    bad_fraction: float = 0.05
    non_stream_fraction: float = 0.05
    adapters: tuple[str, ...] = ()
    churn: bool = True
    churn_interval_s: float = 1.0
    max_tokens: int = 16
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    seed: int = 0


@dataclass
class SoakReport:
    duration_s: float = 0.0
    streams: int = 0
    sent: int = 0
    sent_generation: int = 0
    sent_bad_input: int = 0
    finished_ok: int = 0
    cancelled: int = 0
    cancel_requested_but_finished_first: int = 0
    errored: int = 0
    errors_by_message: dict = field(default_factory=dict)
    unexpected_errors: dict = field(default_factory=dict)
    lost: int = 0
    answered_twice: int = 0
    stray: dict = field(default_factory=dict)
    tokens_received: int = 0
    adapter_ops: dict = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_mismatches: list = field(default_factory=list)
    cancelled_prefix_checked: int = 0
    cancelled_not_prefix: list = field(default_factory=list)
    server_active_after_drain: int | None = None
    kv_blocks_used_after_drain: int | None = None
    kv_blocks_used_metric: float | None = None
    kv_blocks_total: int | None = None
    adapter_refs_outstanding: int | None = None
    adapter_active_outstanding: int | None = None
    server_finished_total: float | None = None
    server_finished_by_reason: dict = field(default_factory=dict)
    server_expected_finished: int = 0
    server_alive: bool = False
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _finished_by_reason(snap: dict) -> dict[str, float]:
    return {k.split('reason="')[1].split('"')[0]: v for k, v in snap.items()
            if k.startswith("loom_request_finished_total{") and f'model="{MODEL}"' in k}


def offline_references(model_dir: str, adapter_root: str, adapters, max_tokens: int, llm=None) -> dict:
    """(prompt, adapter) -> text of an offline engine run (greedy, ignore_eos), adapters by folder name.
    `llm`: a loom.engine.llm.LLM whose adapter root is `adapter_root` (default: a new one)."""
    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams

    if llm is None:
        llm = LLM(model_dir, adapter_roots=[adapter_root], kv_cache_memory_bytes=256 << 20)
    jobs = [(p, a) for a in [None] + list(adapters) for p in PROMPTS]
    outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        lora_names=[a for _, a in jobs])
    return {job: o.text for job, o in zip(jobs, outs)}


def run_soak(cfg: SoakConfig, adapter_root: Path, refs: dict | None, server=None, log=print) -> SoakReport:
    """Run the workers and the churner for cfg.duration_s, drain, check. `refs` from offline_references
    (None: skip the greedy check). `server` (a LocalTritonServer) is checked for being alive."""
    import tritonclient.grpc as grpcclient

    rep = SoakReport(streams=cfg.streams)
    base = _finished_by_reason(scrape(cfg.metrics_url)) if cfg.metrics_url else {}  # the server may be reused
    t0 = time.monotonic()
    deadline = t0 + cfg.duration_s
    recs: list[Rec] = []
    stray: collections.Counter = collections.Counter()
    workers = [Worker(i, cfg, deadline, cfg.seed * 100003 + i, recs, stray) for i in range(cfg.streams)]
    churner = Churner(cfg, deadline, adapter_root) if cfg.churn and cfg.adapters else None
    for w in workers:
        w.start()
    if churner:
        churner.start()
    last = 0.0
    while any(w.is_alive() for w in workers):
        time.sleep(0.5)
        now = time.monotonic()
        if now - last > 10:
            last = now
            done = sum(1 for r in list(recs) if r.done.is_set())
            log(f"[soak] t={now - t0:5.1f}s sent={len(recs)} done={done} live_workers="
                f"{sum(w.is_alive() for w in workers)}")
        if now > deadline + cfg.request_timeout_s + 30:
            rep.failures.append("workers did not finish")
            break
    if churner:
        churner.join(cfg.request_timeout_s)
        rep.adapter_ops = dict(sorted(churner.results.items()))
    rep.duration_s = round(time.monotonic() - t0, 1)

    # ---- client-side counts
    errors = collections.Counter()
    unexpected = collections.Counter()
    parse_refused = 0
    for r in recs:
        rep.sent += 1
        rep.tokens_received += r.tokens
        if r.kind == "gen":
            rep.sent_generation += 1
        else:
            rep.sent_bad_input += 1
        rep.answered_twice += 1 if r.extra else 0
        if r.status == "ok":
            if r.kind != "gen":
                unexpected[f"{r.kind}: accepted, expected a refusal"] += 1
            rep.finished_ok += 1
            rep.cancel_requested_but_finished_first += 1 if r.cancel_late else 0
        elif r.status == "cancelled":
            rep.cancelled += 1
        elif r.status == "lost" or r.status == "pending":
            rep.lost += 1
        else:
            rep.errored += 1
            msg = re.sub(r"[0-9]+", "N", r.error or "")[:140]
            errors[msg] += 1
            if r.kind == "gen":
                expected = r.lora == CHURN and msg.startswith("lora_name:")  # churn unloaded meanwhile
                if not expected:
                    unexpected[f"gen: {msg}"] += 1
            else:
                b = next(b for b in BAD_INPUTS if "bad:" + b.kind == r.kind)
                if not (r.error or "").startswith(b.expect):
                    unexpected[f"{r.kind}: {msg}"] += 1
                if not b.engine:
                    parse_refused += 1
    rep.errors_by_message = dict(errors.most_common())
    rep.unexpected_errors = dict(unexpected.most_common())
    rep.stray = dict(stray)

    # ---- greedy outputs: unchanged by load, cancellation and churn
    if refs is not None:
        for r in recs:
            if r.kind != "gen" or r.status not in ("ok", "cancelled"):
                continue
            if r.lora == CHURN:
                cands = {refs[(r.prompt, cfg.adapters[0])], refs[(r.prompt, cfg.adapters[-1])]}
            else:
                cands = {refs[(r.prompt, r.lora)]}
            if r.status == "ok":
                rep.greedy_checked += 1
                if r.text not in cands:
                    rep.greedy_mismatches.append({"rid": r.rid, "prompt": r.prompt, "lora": r.lora, "got": r.text,
                                                  "expected": sorted(cands)})
            else:
                rep.cancelled_prefix_checked += 1
                if not any(c.startswith(r.text) for c in cands):
                    rep.cancelled_not_prefix.append({"rid": r.rid, "prompt": r.prompt, "lora": r.lora,
                                                     "got": r.text, "expected": sorted(cands)})

    # ---- server side, after the drain
    info = None
    client = grpcclient.InferenceServerClient(cfg.url)
    helper = Churner(cfg, 0, adapter_root)
    drain_deadline = time.monotonic() + cfg.drain_timeout_s
    try:
        while True:
            info, err = helper.op(client, "info", timeout=30)
            if info is not None:
                res = info["result"]
                ad = res.get("adapters") or {}
                if (res["num_active"] == 0 and res["kv_blocks_used"] == 0 and ad.get("refs", 0) == 0) \
                        or time.monotonic() > drain_deadline:
                    break
            elif time.monotonic() > drain_deadline:
                rep.failures.append(f"info adapter_op failed: {err}")
                break
            time.sleep(0.5)
    finally:
        client.close()
    if info is not None:
        res = info["result"]
        ad = res.get("adapters") or {}
        rep.server_active_after_drain = res["num_active"]
        rep.kv_blocks_used_after_drain = res["kv_blocks_used"]
        rep.kv_blocks_total = res["kv_blocks_total"]
        rep.adapter_refs_outstanding = ad.get("refs")
        rep.adapter_active_outstanding = ad.get("active")
    if cfg.metrics_url:
        time.sleep(0.3)  # gauges are refreshed every 50 ms
        try:
            snap = scrape(cfg.metrics_url)
            rep.kv_blocks_used_metric = metric(snap, "loom_kv_blocks_used", model=MODEL)
            after = _finished_by_reason(snap)
            rep.server_finished_by_reason = {k: v - base.get(k, 0.0) for k, v in after.items()
                                             if v - base.get(k, 0.0)}
            rep.server_finished_total = sum(rep.server_finished_by_reason.values())
        except Exception as e:  # noqa: BLE001
            rep.failures.append(f"metrics scrape failed: {e}")
    rep.server_expected_finished = rep.sent - parse_refused
    rep.server_alive = server.is_ready() if server is not None else True

    # ---- invariants
    f = rep.failures
    if rep.lost:
        f.append(f"{rep.lost} requests lost (no final response)")
    if rep.answered_twice:
        f.append(f"{rep.answered_twice} requests answered after their final response")
    if rep.stray:
        f.append(f"stray responses/errors: {rep.stray}")
    if rep.unexpected_errors:
        f.append(f"unexpected errors: {rep.unexpected_errors}")
    if rep.server_active_after_drain != 0:
        f.append(f"server still tracks {rep.server_active_after_drain} requests after the drain")
    if rep.kv_blocks_used_after_drain != 0:
        f.append(f"{rep.kv_blocks_used_after_drain} KV blocks still used after the drain")
    if rep.kv_blocks_used_metric not in (None, 0.0):
        f.append(f"loom_kv_blocks_used = {rep.kv_blocks_used_metric} after the drain")
    if cfg.adapters and rep.adapter_refs_outstanding != 0:
        f.append(f"{rep.adapter_refs_outstanding} adapter refs outstanding after the drain")
    if rep.server_finished_total is not None and rep.server_finished_total != rep.server_expected_finished:
        f.append(f"the server finished {rep.server_finished_total:g} requests; {rep.server_expected_finished} "
                 f"reached it (each must finish exactly once)")
    if rep.greedy_mismatches:
        f.append(f"{len(rep.greedy_mismatches)} greedy outputs differ from the offline engine")
    if rep.cancelled_not_prefix:
        f.append(f"{len(rep.cancelled_not_prefix)} cancelled outputs are not a prefix of the offline output")
    if rep.finished_ok == 0:
        f.append("no request finished")
    if cfg.cancel_fraction > 0 and rep.cancelled == 0:
        f.append("no request was cancelled")
    if not rep.server_alive:
        f.append("the server is not alive")
    return rep


def format_report(rep: SoakReport) -> str:
    d = asdict(rep)
    lines = ["", "==== soak report ===="]
    order = ["duration_s", "streams", "sent", "sent_generation", "sent_bad_input", "finished_ok", "cancelled",
             "cancel_requested_but_finished_first", "errored", "lost", "answered_twice", "tokens_received",
             "greedy_checked", "cancelled_prefix_checked", "server_active_after_drain", "kv_blocks_used_after_drain",
             "kv_blocks_used_metric", "kv_blocks_total", "adapter_refs_outstanding", "adapter_active_outstanding",
             "server_finished_total", "server_expected_finished", "server_alive"]
    for k in order:
        lines.append(f"{k:40s} {d[k]}")
    for k in ("errors_by_message", "unexpected_errors", "server_finished_by_reason", "adapter_ops", "stray"):
        lines.append(f"{k}:")
        for m, n in d[k].items():
            lines.append(f"  {n:6g}  {m}")
    for k in ("greedy_mismatches", "cancelled_not_prefix"):
        if d[k]:
            lines.append(f"{k} (first 5 of {len(d[k])}):")
            lines += [f"  {json.dumps(x)[:400]}" for x in d[k][:5]]
    lines.append("RESULT: " + ("PASS" if rep.ok else "FAIL\n  " + "\n  ".join(rep.failures)))
    return "\n".join(lines)
