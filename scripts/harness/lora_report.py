"""bench_lora's report (scripts/bench_lora.py): the table of tokens/s by system and scenario, the bandwidth ceiling of
the distinct-adapter run, the ratios within each round, and the TARGET lines, each `met` or `NOT met`."""
from __future__ import annotations

import statistics

import harness.bench as bc
from harness.adapter_cost import distinct_ceiling
from harness.vllm_peer import compute_threads

SCENARIOS = ("no_lora", "one_adapter", "distinct_adapters")


def same(a, b) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def adapter_ratios(res: dict) -> tuple[float, float]:
    """One adapter's and the distinct adapters' tokens/s over the same system's no-LoRA tokens/s."""
    base = res["no_lora"]["tokens_per_s"]
    one, dis = (bc.ratio(res[s]["tokens_per_s"], base) for s in ("one_adapter", "distinct_adapters"))
    return one, dis


def report(results: dict, args) -> str:
    looms, vl = results["loom"], results.get("vllm") or {}  # looms: {compute threads (str): its results}
    n = args.requests
    dtype = next(iter(looms.values())).get("dtype", "float32")  # the model's, for loom and vLLM alike
    lines = [f"{n} requests x {args.max_tokens} tokens, {args.prompt_len}-token random prompts, {dtype} model, "
             f"rank-{args.rank} {args.adapter_dtype} adapters on all 7 projections, greedy, all at t0; loom "
             f"{args.compile} with {' and '.join(looms)} compute thread(s); best of {args.repeats}; other CPU s = "
             "other processes during the timed batches"]
    rows = []

    def row(name, res, ref=None):
        base = res.get("no_lora", {}).get("tokens_per_s")
        cells = [name]
        for sc in SCENARIOS:
            r = res.get(sc)
            cells.append(r["tokens_per_s"] if r else None)
            if sc != "no_lora":
                cells.append(bc.ratio(r["tokens_per_s"], base) if r and base else None)
        cells.append(" / ".join(same(res[sc]["tokens"], ref[sc]["tokens"]) if ref and sc in ref and sc in res
                                else "-" for sc in SCENARIOS))
        cells.append(max((res[sc]["cpu"]["other_cpu_s"] for sc in SCENARIOS if sc in res), default=None))
        cells.append(res.get("startup_s") or (res.get("no_lora") or {}).get("startup_s"))
        rows.append(cells)

    if vl:
        row("vllm (best)", vl)
        for s, res in vl.get("_per_setting", {}).items():
            row(f"vllm {s} ({compute_threads(s)}t)", res)
    for t, res in looms.items():
        row(f"loom ({t}t)", res, vl or None)
    lines.append(bc.table(["system", "no LoRA tok/s", "one adapter", "ratio", f"{n} distinct", "ratio",
                           "same tokens as vLLM (none/one/distinct)", "other CPU s (max)", "start-up s"], rows))
    if vl:
        settings = {sc: vl[sc]["setting"] for sc in SCENARIOS if sc in vl}
        version = next((v["vllm_version"] for v in vl.values() if isinstance(v, dict) and v.get("vllm_version")), "?")
        lines.append(f"vLLM {version}: best thread setting per row "
                     f"{settings}; its LoRA engine: max_loras {vl.get('one_adapter', {}).get('max_loras')} "
                     f"(adapters + 1 spare slot, the vllm#48421 workaround), no-LoRA in that engine "
                     f"{vl.get('no_lora_lora_engine', {}).get('tokens_per_s', float('nan')):.1f} tok/s")
        startups = {k: v["startup_s"] for k, v in vl["_all"].items() if "error" not in v}
        lines.append("start-up (load + compile): " + ", ".join(f"{k} {v:.1f}s" for k, v in startups.items())
                     + "".join(f", loom {t}t {res['startup_s']:.1f}s" for t, res in looms.items()))
    checks = []
    for t, res in looms.items():
        one, dis = adapter_ratios(res)
        ceiling = ""
        if res.get("stream_gb_s") and results.get("adapter_bytes"):
            gbps, nbytes = res["stream_gb_s"], n * results["adapter_bytes"]
            cap = distinct_ceiling(res["no_lora"]["tokens_per_s"], n, args.max_tokens, results["adapter_bytes"], gbps)
            lines.append(f"loom ({t}t): {n} distinct adapters read {nbytes / 1e6:.0f} MB a decode step; at the "
                         f"{gbps:.1f} GB/s this machine reads on {t} thread(s), reading them after the rest of the "
                         f"step would cap the distinct ratio at {cap:.2f} (LoRA FLOPs not counted; loom reads them "
                         f"while its GEMMs compute)")
            ceiling = f" (bound if read after the GEMMs {cap:.2f})"
        phases = phase_line(t, res, n, results.get("adapter_bytes"))
        if phases:
            lines.append(phases)
        rounds = res.get("rounds") or []
        if len(rounds) > 1:  # ratios within each round (its three scenarios ran back to back)
            per = [adapter_ratios({s: {"tokens_per_s": r[s]} for s in SCENARIOS}) for r in rounds]
            lines.append(f"loom ({t}t), ratios within each round (one adapter / distinct): "
                         + "; ".join(f"{a:.3f} / {b:.3f}" for a, b in per)
                         + f"; median {statistics.median(a for a, _ in per):.3f} / "
                         f"{statistics.median(b for _, b in per):.3f}")
        # four decimals: 0.9499 is not met, and fewer would print it as 0.95
        checks += [(f"loom ({t}t): {n} distinct >= 0.85x loom's no-LoRA", dis >= 0.85, f"{dis:.4f}x{ceiling}"),
                   (f"loom ({t}t): one adapter >= 0.95x", one >= 0.95, f"{one:.4f}x")]
    if vl and all(s in vl for s in SCENARIOS):
        v_one, v_dis = adapter_ratios(vl)
        vb = vl["no_lora"]["tokens_per_s"]
        best = max(looms, key=lambda t: looms[t]["no_lora"]["tokens_per_s"])
        base = looms[best]["no_lora"]["tokens_per_s"]
        checks.append((f"loom no-LoRA above vLLM's (loom {best}t, vLLM {vl['no_lora']['setting']})", base > vb,
                       f"{base:.1f} vs {vb:.1f} tok/s"))
        for t, res in looms.items():
            one, dis = adapter_ratios(res)
            checks.append((f"loom ({t}t): both adapter ratios above vLLM's", one > v_one and dis > v_dis,
                           f"one {one:.2f} vs {v_one:.2f}, distinct {dis:.2f} vs {v_dis:.2f}"))
        if dtype == "float32" and args.adapter_dtype == "float32":
            ident = all(same(res[s]["tokens"], vl[s]["tokens"]) == f"{n}/{n}"
                        for res in looms.values() for s in SCENARIOS)
            checks.append((f"tokens identical {n}/{n} in every row", ident, ""))
        else:  # two 16-bit implementations round at different places: the table's column is information only
            lines.append(f"tokens identical to vLLM's: not asked with a {dtype} model and {args.adapter_dtype} "
                         "adapters (16-bit rounding differs between implementations)")
        for t, res in looms.items():  # against vLLM computing on as many threads as loom
            eq = next((s for s in vl.get("_per_setting", {}) if compute_threads(s) == int(t)), None)
            if eq is None:
                continue
            v = vl["_per_setting"][eq]
            vb = v["no_lora"]["tokens_per_s"]
            base = res["no_lora"]["tokens_per_s"]
            one, dis = adapter_ratios(res)
            v_one, v_dis = adapter_ratios(v)
            checks += [(f"at equal compute (loom {t}t, vLLM {eq}): loom no-LoRA above vLLM's", base > vb,
                        f"{base:.1f} vs {vb:.1f} tok/s"),
                       (f"at equal compute (loom {t}t, vLLM {eq}): both adapter ratios above vLLM's",
                        one > v_one and dis > v_dis,
                        f"one {one:.2f} vs {v_one:.2f}, distinct {dis:.2f} vs {v_dis:.2f}")]
    for what, ok, detail in checks:
        lines.append(f"TARGET {what}: {detail} {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def phase_line(t: str, res: dict, n: int, adapter_bytes: int | None) -> str | None:
    """Where the adapters' time goes in one loom engine's batches (each scenario's best): the prefill steps' total
    and the median decode step, none / one / distinct, the LoRA's additions to each, and the distinct decode step's
    addition against reading its n adapters' rows at the streaming rate measured (res["stream_gb_s"])."""
    st = [(res.get(sc) or {}).get("steps") for sc in SCENARIOS]
    if not all(st) or any(x["decode_ms"] is None for x in st):
        return None
    pre, dec = [x["prefill_ms"] for x in st], [x["decode_ms"] for x in st]
    text = (f"loom ({t}t), where the time goes (each scenario's best batch): prefill {pre[0]:.0f} / {pre[1]:.0f} / "
            f"{pre[2]:.0f} ms ({st[0]['prefill_steps']} step(s)), decode step median {dec[0]:.1f} / {dec[1]:.1f} / "
            f"{dec[2]:.1f} ms ({st[0]['decode_steps']} steps), none / one / distinct: the LoRA added "
            f"{pre[1] - pre[0]:+.0f} / {pre[2] - pre[0]:+.0f} ms of prefill and {dec[1] - dec[0]:+.1f} / "
            f"{dec[2] - dec[0]:+.1f} ms a decode step")
    if adapter_bytes and res.get("stream_gb_s"):
        read_ms = n * adapter_bytes / (res["stream_gb_s"] * 1e9) * 1000
        text += (f"; the distinct decode step's rows ({n * adapter_bytes / 1e6:.0f} MB) take {read_ms:.1f} ms at "
                 f"{res['stream_gb_s']:.1f} GB/s ({(dec[2] - dec[0]) / read_ms:.2f}x that added)")
    return text


# ---- bench_lora --adapters: many adapters under traffic ----------------------------------------------------------

def traffic_report(results: dict, args) -> str:
    """The many-adapter runs (bench_lora.traffic): tokens/s against one adapter, queue time by popularity decile and
    against the scheduler's bound, time to first token by the adapter's tier at arrival, load latencies, and step
    time with and without a read from disk in flight; TARGET lines as above."""
    from harness.lora import admission_bound

    runs, w = results["runs"], results["max_lora_wait_steps"]
    base = runs["one adapter"]
    base_tps = base["tokens"] / base["wall_s"]
    lines = [f"{args.adapters} rank-{args.rank} {args.adapter_dtype} adapters on all 7 projections, device rows for "
             f"{args.device_adapters}, host tier {args.host_adapters}; {args.arrivals} requests x {args.max_tokens} "
             f"tokens, {args.prompt_len}-token prompts, Poisson at {results['rate']:.2f} req/s ({args.load:.2f} x the "
             f"one-adapter closed batch's {results['closed_tokens_per_s']:.1f} tok/s); max_lora_wait_steps {w}; "
             f"queue = steps (ms) from arrival to first token; "
             + (f"each popularity run after {args.warm} one-token requests from its popularity (the host tier and "
                "device rows warm)" if args.warm else "each popularity run starts cold")]
    rows, deciles, firsts, itl, checks = [], [], [], [], []
    for pop, run in runs.items():
        rq = run["requests"]
        q_steps = [f - a for f, a in zip(rq["first_step"], rq["arrival_step"])]
        q_ms = [1000 * (f - a) for f, a in zip(rq["first_t"], rq["arrival_t"])]
        excess = max(q - b for q, b in zip(q_steps, admission_bound(rq["arrival_step"], rq["first_step"],
                                                                     rq["last_step"], w)))
        tiers = [t for t, _ in run["loads"]]
        tps = run["tokens"] / run["wall_s"]
        rows.append([pop, tps, bc.ratio(tps, base_tps), bc.percentile(q_steps, 50), bc.percentile(q_steps, 99),
                     max(q_steps), excess, bc.percentile(q_ms, 99), run["evictions"],
                     tiers.count("disk_to_host"), tiers.count("host_to_device")])
        if pop == "one adapter":
            continue
        for d in range(10):
            sel = [i for i, k in enumerate(run["ranks"]) if k * 10 // args.adapters == d]
            deciles.append([pop, f"{d + 1} (ad{d * args.adapters // 10}..)", len(sel),
                            bc.percentile([q_steps[i] for i in sel], 99), bc.percentile([q_ms[i] for i in sel], 99)])
        for tier in ("device", "host", "disk", "loading"):
            sel = [q_ms[i] for i, t in enumerate(rq["tier"]) if t == tier]
            if sel:
                firsts.append([pop, f"request, adapter in {tier}", len(sel), bc.percentile(sel, 50),
                               bc.percentile(sel, 99)])
        for tier in ("disk_to_host", "host_to_device"):
            sel = [1000 * s for t, s in run["loads"] if t == tier]
            if sel:
                firsts.append([pop, f"load {tier}", len(sel), bc.percentile(sel, 50), bc.percentile(sel, 99)])
        quiet = [(1000 * s, b) for s, b, decode, loading, _ in run["steps"] if decode and not loading]
        busy = [(1000 * s, b) for s, b, decode, loading, _ in run["steps"] if decode and loading]
        quiet_r, busy_r = matched_ratios(quiet, quiet), matched_ratios(quiet, busy)
        itl += [[pop, what, len(x), statistics.mean(b for _, b in x) if x else None,
                 bc.percentile([ms for ms, _ in x], 50), bc.percentile([ms for ms, _ in x], 99), len(r),
                 bc.percentile(r, 50), bc.percentile(r, 99)]
                for what, x, r in (("no read in flight", quiet, quiet_r), ("a disk read in flight", busy, busy_r))]
        checks += [(f"{pop}: tokens/s >= 0.80x one adapter", tps >= 0.8 * base_tps, f"{bc.ratio(tps, base_tps):.3f}x"),
                   (f"{pop}: every request's queue time within the stated bound", excess <= 0,
                    f"max excess {excess} steps, max queue {max(q_steps)} steps (W {w})")]
        if busy:  # set against steps of about the same batch: a step's time grows with its batch
            what = (f"{pop}: step time while a disk read is in flight, over steps of the same batch without, p99 "
                    f"within 5% of the same ratio among steps without")
            if busy_r and quiet_r:
                p99q, p99b = bc.percentile(quiet_r, 99), bc.percentile(busy_r, 99)
                checks.append((what, p99b <= 1.05 * p99q,
                               f"{p99b:.2f} vs {p99q:.2f} ({len(busy_r)} and {len(quiet_r)} steps matched)"))
            else:
                checks.append((what, False, f"not measured: none of the {len(busy)} steps with a read in flight has "
                               f"{MATCH_MIN} steps of its batch without one"))
    lines.append(bc.table(["run", "tok/s", "ratio", "queue p50", "p99", "max", "max - bound", "queue p99 ms",
                           "evictions", "disk reads", "host->device"], rows, digits=2))
    lines += cost_lines(results, runs)
    lines.append("queue time by popularity decile of the adapters (decile 1 = the most popular tenth):")
    lines.append(bc.table(["run", "decile", "requests", "queue p99 steps", "queue p99 ms"], deciles))
    lines.append("first use: time to first token by where the adapter was when its request arrived; load latencies:")
    lines.append(bc.table(["run", "what", "n", "p50 ms", "p99 ms"], firsts))
    lines.append("decode-only steps (the running streams' inter-token latency; steps with a prompt left out); "
                 "'/ same batch': a step's time over the median of the steps without a read whose batch is within "
                 f"{MATCH_TOL:.0%} of its own (itself left out; steps with fewer than {MATCH_MIN} such left out):")
    lines.append(bc.table(["run", "steps", "n", "mean batch", "p50 ms", "p99 ms", "matched", "/ same batch p50",
                           "p99"], itl))
    if results.get("shift"):
        lines += shift_lines(results["shift"], runs, checks)
    lines += vllm_traffic_lines(results.get("vllm") or {}, runs, args.adapters, checks)
    for what, ok, detail in checks:
        lines.append(f"TARGET {what}: {detail} {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def cost_lines(results: dict, runs: dict) -> list[str]:
    """Per run, two costs the one-adapter run does not pay in full, against its wall time: the rank rows its steps
    read (each step its distinct adapters' rows once; at the streaming rate measured on the engine's threads, when it
    was: the CPU device) and the loader process's CPU time (its boot only where it started within the run)."""
    gbps, nbytes = results.get("stream_gb_s"), results.get("adapter_bytes")
    out = []
    for pop, run in runs.items():
        rows_gb = sum(d for *_, d in run["steps"]) * nbytes / 1e9 if nbytes else None
        what = [f"its steps read {rows_gb:.1f} GB of rank rows"] if rows_gb is not None else []
        if rows_gb is not None and gbps:
            what[-1] += (f" ({rows_gb / gbps:.2f} s at the {gbps:.1f} GB/s read here: "
                         f"{rows_gb / gbps / run['wall_s']:.0%} of its {run['wall_s']:.1f} s)")
        if run.get("loader_cpu_s") is not None:
            what.append(f"the loader process {run['loader_cpu_s']:.2f} s of CPU")
        if what:
            out.append(f"{pop}: " + "; ".join(what))
    return out


MATCH_TOL, MATCH_MIN = 0.2, 3


def matched_ratios(ref: list[tuple[float, int]], steps: list[tuple[float, int]]) -> list[float]:
    """Each step's (ms, batch) time over the median time of the `ref` steps whose batch is within MATCH_TOL of its
    own (the step itself left out when it is one of them); steps with fewer than MATCH_MIN such left out."""
    out = []
    for i, (ms, b) in enumerate(steps):
        near = [m for j, (m, rb) in enumerate(ref) if b / (1 + MATCH_TOL) <= rb <= b * (1 + MATCH_TOL)
                and not (steps is ref and j == i)]
        if len(near) >= MATCH_MIN:
            out.append(ms / statistics.median(near))
    return out


def shift_lines(shift: dict, runs: dict, checks: list) -> list[str]:
    """The popularity shift (bench_lora --shift-at): per run, the token rate before it, its lowest window after it and
    the time until throughput recovers (harness.lora.recovery_s); a TARGET that it recovers before arrivals end."""
    from harness.lora import recovery_s

    rows = []
    for pop, run in runs.items():
        if pop == "one adapter":
            continue
        try:
            base, low, rec = recovery_s(run["token_times"], shift["t"], shift["end_t"], shift["window_s"])
        except ValueError as e:  # a run too short for its windows: said, not a crash after minutes of benchmark
            rows.append([pop, None, None, None, str(e)])
            continue
        rows.append([pop, base, low, bc.ratio(low, base), "never" if rec is None else rec])
        checks.append((f"{pop}: throughput recovers after the popularity shift", rec is not None,
                       "never" if rec is None else f"{rec:.1f} s"))
    return [f"popularity shift at request {shift['request']} ({shift['t']:.1f} s; arrivals end at "
            f"{shift['end_t']:.1f} s), token rate in {shift['window_s']:g} s windows; recovered = every later window "
            f">= 0.9x the median before:",
            bc.table(["run", "tok/s before", "lowest after", "ratio", "recovered after s"], rows, digits=2)]


def vllm_traffic_lines(vllm: dict, runs: dict, n_adapters: int, checks: list) -> list[str]:
    """vLLM's rows beside loom's for the same traffic (bench_lora.run_vllm_traffic): tokens/s and its ratio to its own
    one-adapter run, time to first token from arrival (loom's "queue ms" above is the same measure) overall and by
    popularity decile; a TARGET per popularity run: loom's tokens/s above vLLM's best setting."""
    if not vllm:
        return []
    lines, rows, deciles = [], [], []
    for setting, res in vllm.items():
        if "error" in res:
            lines.append(f"{setting}: FAILED ({res['error'].splitlines()[0]})")
            continue
        base = res["runs"]["one adapter"]["tokens_per_s"]
        for pop, r in res["runs"].items():
            ttft = [1000 * q["ttft_s"] for q in r["requests"]]
            rows.append([setting, pop, r["tokens_per_s"], bc.ratio(r["tokens_per_s"], base), bc.percentile(ttft, 50),
                         bc.percentile(ttft, 99)])
            if pop == "one adapter":
                continue
            for d in range(10):
                sel = [ttft[i] for i, k in enumerate(runs[pop]["ranks"]) if k * 10 // n_adapters == d]
                deciles.append([setting, pop, d + 1, len(sel), bc.percentile(sel, 99)])
    ok = {k: v for k, v in vllm.items() if "error" not in v}
    if rows:
        warm = any(r.get("warm") for r in runs.values())
        lines.append(f"vLLM {next(iter(ok.values())).get('vllm_version', '')} on the same requests and arrivals "
                     f"(max_loras = device rows, max_cpu_loras = host tier"
                     f"{'; each run after the same warm-up requests' if warm else ''}):")
        lines.append(bc.table(["vllm", "run", "tok/s", "ratio", "TTFT p50 ms", "TTFT p99 ms"], rows, digits=2))
        lines.append("vLLM time to first token by popularity decile:")
        lines.append(bc.table(["vllm", "run", "decile", "requests", "TTFT p99 ms"], deciles))
    for pop, run in runs.items():
        if not ok:
            break
        tps = run["tokens"] / run["wall_s"]
        best = max(ok, key=lambda k: ok[k]["runs"][pop]["tokens_per_s"])
        vt = ok[best]["runs"][pop]["tokens_per_s"]
        checks.append((f"{pop}: loom tokens/s above vLLM's ({best})", tps > vt, f"{tps:.1f} vs {vt:.1f} tok/s "
                       f"({bc.ratio(tps, vt):.2f}x)"))
    return lines
