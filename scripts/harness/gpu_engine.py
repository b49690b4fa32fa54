"""gpu_check sections `engine` (the engine vs transformers) and `lora` (multi-LoRA vs PEFT) on the device.

engine: small random models covering GQA groups 1/4/8, head_dim 64/128, Qwen2 q/k/v bias and tied embeddings
(--cpu-smoke: one model, smaller heads). Three engines per model (four on the first), the fewest that cover the cases
(engines()), each with small limits (ENGINE_LIMITS) so its start-up warm-up compiles and captures no more than the
checks can reach.
fp32 with CUDA graphs and a 12-block KV cache: the mixed plan (mixed prefill/decode steps, a duplicate prompt in
one step, prefix-cache hits), then the preemption plan; fp32 eager under a 16-token budget: the chunked plan and
the mixed plan chunked; on the first model, fp32 with speculative decoding (the model its own draft): the mixed plan
with every later decode step a verify step replaying a verify graph. Greedy tokens must equal transformers' generate,
and each plan asserts what it is for
happened (mixed steps, prefix hits, chunks, preemptions, graph replays on the graphs engines and none on the
eager one; --cpu-smoke runs the graph path without capture). In bfloat16 the
engine's tokens are teacher-forced through transformers in float32 on the same bf16-rounded weights: the
engine's logprob of each token within BF16_LOGPROB_TOL of the oracle's (mean within BF16_LOGPROB_MEAN_TOL), and
its token the oracle's top-1 except where the oracle's top two are closer than BF16_TIE_MARGIN.
lora: PEFT adapters of ranks 1-16 with different targets and options, and rows without adapter, in one step
(float32 tokens identical to PEFT, logprobs within 2e-4); then load / reload / unload under a serving name.
"""
from __future__ import annotations

from pathlib import Path

import torch

from harness.hf_models import assert_no_leak, hf_greedy, make_hf_model, random_prompts
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError

# bf16 bounds, nats. Calibrated with the engine's CPU references in bf16 on these models (max / mean |error| of the
# chosen token's logprob: 0.086 / 0.026 for the Mistral GQA-8 model, the worst); a wrong kernel is off by ~1.
BF16_LOGPROB_TOL = 0.25  # largest |engine - oracle| logprob of a chosen token
BF16_LOGPROB_MEAN_TOL = 0.06  # mean of the same: catches a small systematic error the max lets through
BF16_TIE_MARGIN = 0.2  # oracle top-1 minus top-2 below this: either token is a correct greedy choice
VOCAB = 320  # make_hf_model's vocabulary


def model_configs(smoke: bool) -> list[tuple[str, str, bool, float, dict]]:
    """(label, arch, tied, bias std, config overrides)."""
    if smoke:  # one model: the schedules' code paths (tests/engine covers the families on CPU)
        return [("qwen2 gqa4 hd16 bias tied", "qwen2", True, 0.5, dict(hidden_size=64, num_attention_heads=4,
                                                                       num_key_value_heads=1, intermediate_size=96))]
    return [("llama gqa4 hd64", "llama", False, 0.0, dict(hidden_size=512, num_attention_heads=8,
                                                         num_key_value_heads=2, intermediate_size=1024)),
            ("qwen2 gqa1 hd128 bias tied", "qwen2", True, 0.5, dict(hidden_size=256, num_attention_heads=2,
                                                                    num_key_value_heads=2, intermediate_size=512)),
            ("mistral gqa8 hd128", "mistral", False, 0.0, dict(hidden_size=1024, num_attention_heads=8,
                                                               num_key_value_heads=1, intermediate_size=1024))]


# ---- driving the engine ----------------------------------------------------------------------------------


def on_batch(engine, fn):
    """Call fn(batch) with every batch the engine's model runner runs; returns a function that undoes it."""
    orig = engine.runner.run

    def run(batch, lora):
        fn(batch)
        return orig(batch, lora)

    engine.runner.run = run
    return lambda: setattr(engine.runner, "run", orig)


def spy_steps(engine) -> dict:
    """Count steps that mix decodes with prefills, and steps that prefill only part of a prompt (chunks)."""
    stats = {"steps": 0, "mixed": 0, "chunked": 0}

    def see(batch):
        d, seqs = batch.num_decode_seqs, batch.seqs
        stats["steps"] += 1
        stats["mixed"] += 0 < d < len(seqs)
        stats["chunked"] += any(n < q.num_tokens - q.num_computed_tokens
                                for q, n in zip(seqs[d:], batch.num_scheduled_tokens[d:]))

    on_batch(engine, see)
    return stats


def drive(engine, plan, params, max_steps: int = 5000) -> dict:
    """plan: (step to add it at, request id, prompt, lora name). Returns request id -> final state."""
    pending = sorted(plan, key=lambda p: p[0])
    res: dict[str, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, lora = pending.pop(0)
            engine.add_request(rid, prompt, params, lora)
            res[rid] = {"tokens": [], "logprobs": [], "cached": 0, "reason": None}
        for o in engine.step():
            r = res[o.request_id]
            assert o.error is None, f"{o.request_id}: {o.error}"
            r["tokens"] += o.new_token_ids
            r["logprobs"] += o.new_logprobs or []
            r["cached"], r["reason"] = o.num_cached_tokens, o.finish_reason
        step += 1
        assert step < max_steps, "the engine did not finish its requests"
    return res


def _engine(path, dev, dtype, **kw):
    args = dict(model=path, device=dev, dtype=dtype, block_size=16, kv_cache_memory_bytes=16 << 20)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), load_tokenizer=False)
    if dev == "cpu" and args.get("cuda_graphs", True):  # --cpu-smoke: the graph path's code, without capture
        eng.runner.enable_graph_emulation()
    return eng


def warmup_metrics(eng) -> dict:
    """What the engine's start-up warm-up did (loom.engine.worker.warmup.WarmupReport), and the graphs it holds."""
    w = eng.runner.warmup
    g = eng.runner.graphs
    out = {"graphs": len(g._graphs) if g is not None else 0, "graph_buckets": g.buckets if g is not None else []}
    if w is not None:
        out.update(warmup_steps=w.steps, warmup_lora_launches=w.lora_launches, warmup_compiles=w.compiles,
                   warmup_s=w.seconds)
    return out


def graph_steps(eng) -> int:
    return eng.runner.graphs.replays if eng.runner.graphs is not None else 0


def _greedy(n, logprobs=None):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


# The engines of the section: the fewest that cover its cases. Small limits (the plans never run more than six
# sequences, 87 tokens in a step or 60 in a sequence): the start-up warm-up compiles every tile class and captures
# every graph bucket up to these, and nothing the checks reach lies above them.
ENGINE_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128)
LORA_LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=512, max_lora_rank=16)  # 14 rows of up to 43 tokens
PREEMPT_BLOCKS = 12  # KV blocks of the graphs engine: the preemption plan needs ~16, the mixed plan's prefix survives


def plans(smoke: bool) -> dict:
    """name -> (plan, tokens per request, what the spy / engine must show)."""
    p = random_prompts([40, 7, 20, 5, 50, 37, 9, 20, 25, 18, 30], VOCAB, seed=21)
    a = p[0]
    n = 4 if smoke else 12
    mixed = [(0, "A", a, None), (0, "B", p[1], None), (0, "A-dup", list(a), None),  # a duplicate in the same step
             (3, "A-ext", a + p[3], None), (3, "C", p[2], None),  # arrive while A and B decode: mixed steps
             (n + 2, "A-again", list(a), None)]  # after A finished: hits its cached blocks
    return {"mixed": (mixed, n, "mixed prefix"),
            "chunked": ([(0, f"c{i}", q, None) for i, q in enumerate(p[4:7])], n, "chunked"),
            "preempt": ([(0, f"p{i}", q, None) for i, q in enumerate(p[7:11])], 30, "preempt")}


def engines() -> dict:
    """engine name -> (dtype, engine kwargs (kv_blocks: a KV cache of that many blocks), [(check name, plan)]).
    fp32 graphs: the mixed plan (duplicate prompts in one step, prefix hits) then preemption on the same engine;
    fp32 eager under a 16-token budget: the chunked plan and the mixed plan chunked, every step eager; bf16: the
    mixed plan against the oracle."""
    return {
        "fp32 graphs": ("float32", dict(kv_blocks=PREEMPT_BLOCKS), [
            ("mixed prefill/decode + duplicate prompts + prefix hits", "mixed"),
            (f"preemption ({PREEMPT_BLOCKS} KV blocks)", "preempt")]),
        "fp32 eager, 16-token budget": ("float32", dict(cuda_graphs=False, max_num_batched_tokens=16), [
            ("chunked prefill", "chunked"), ("mixed schedule chunked, every step eager", "mixed")]),
        "bf16 graphs": ("bfloat16", {}, [("mixed schedule vs the fp32 oracle on bf16-rounded weights", "mixed")]),
        # the first model only: the model is its own draft, so every step after a request's first token verifies
        # proposals (all accepted in fp32), through the verify graphs (loom.engine.worker.verify_graphs)
        SPEC_ENGINE: ("float32", dict(speculative_config=SELF_DRAFT), [
            ("speculative decoding, verify steps replaying CUDA graphs", "mixed")]),
    }


SPEC_ENGINE = "fp32 graphs, speculative (its own draft)"
SELF_DRAFT = "self"  # build_engine: speculative_config with the engine's own model as the draft


def check_spec(eng, model, plan) -> dict:
    """Greedy tokens identical to transformers with every decode step after the first a verify step, and the verify
    steps replayed as CUDA graphs (on CPU: the emulated path)."""
    plan, n, _ = plan
    res = drive(eng, plan, _greedy(n))
    for _, rid, prompt, _ in plan:
        assert res[rid]["tokens"] == hf_greedy(model, prompt, n), f"{rid} diverged from transformers"
    st = eng.stats().spec_decoding
    replays = eng.runner.verify_graphs.replays if eng.runner.verify_graphs is not None else 0
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens, f"acceptance {st}"
    assert replays > 0, "no verify step replayed a CUDA graph"
    assert_no_leak(eng)
    return {"verify_graph_steps": replays, "draft_tokens": st.num_draft_tokens, "accepted": st.num_accepted_tokens}


def kv_block_bytes(model, dtype_bytes: int = 4) -> int:
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * hd * dtype_bytes


def build_engine(path, model, dev, dtype, kw) -> object:
    kw = dict(ENGINE_LIMITS, **kw)
    if kw.get("speculative_config") == SELF_DRAFT:
        kw["speculative_config"] = dict(method="draft_model", model=path, num_speculative_tokens=3, backoff="off")
    blocks = kw.pop("kv_blocks", None)
    if blocks is not None:
        kw["kv_cache_memory_bytes"] = blocks * kv_block_bytes(model)
    return _engine(path, dev, dtype, **kw)


def check_fp32(eng, model, plan) -> dict:
    plan, n, must = plan
    spy = spy_steps(eng)
    sc = eng.scheduler
    hits0, pre0, graphs0 = sc.prefix_hit_tokens, sc.num_preemptions, graph_steps(eng)
    res = drive(eng, plan, _greedy(n))
    oracle = {}
    for _, rid, prompt, _ in plan:
        key = tuple(prompt)
        if key not in oracle:
            oracle[key] = hf_greedy(model, prompt, n)
        assert res[rid]["tokens"] == oracle[key], f"{rid} ({len(prompt)} prompt tokens) diverged from transformers"
    hits, pre, graphs = sc.prefix_hit_tokens - hits0, sc.num_preemptions - pre0, graph_steps(eng) - graphs0
    if "mixed" in must:
        assert spy["mixed"] > 0, "no step mixed decodes with prefills"
    if "prefix" in must:
        assert hits > 0 and res["A-again"]["cached"] >= 32, "no prefix-cache hit"
    if "chunked" in must:
        assert spy["chunked"] > 0, "no prompt was chunked"
    if "preempt" in must:
        assert pre > 0, "nothing was preempted"
    if eng.config.cuda_graphs:
        assert graphs > 0, "no decode step replayed a CUDA graph"
    else:
        assert graphs == 0, "cuda_graphs is off but a step replayed a graph"
    assert_no_leak(eng)
    return dict(spy, requests=len(plan), prefix_hit_tokens=hits, preemptions=pre, graph_steps=graphs)


def check_bf16(eng, model, plan) -> dict:
    """Engine in bf16 vs transformers in fp32 on the bf16-rounded weights, teacher-forced on the engine's tokens."""
    plan, n, _ = plan
    res = drive(eng, plan, _greedy(n, logprobs=1))
    worst, err_sum, agree, ties, total = 0.0, 0.0, 0, 0, 0
    for _, rid, prompt, _ in plan:
        toks = res[rid]["tokens"]
        ids = torch.tensor([prompt + toks[:-1]], device=model.device)
        with torch.no_grad():
            lsm = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:].float(), -1)
        for i, t in enumerate(toks):
            got = res[rid]["logprobs"][i].logprob
            worst = max(worst, abs(got - float(lsm[i, t])))
            err_sum += abs(got - float(lsm[i, t]))
            top2 = lsm[i].topk(2).values
            total += 1
            if int(lsm[i].argmax()) == t:
                agree += 1
            elif float(top2[0] - lsm[i, t]) < BF16_TIE_MARGIN:
                ties += 1
            else:
                raise AssertionError(f"{rid} step {i}: token {t} is {float(top2[0] - lsm[i, t]):.3f} nats below "
                                     f"the oracle's top-1 {int(lsm[i].argmax())}")
    assert worst <= BF16_LOGPROB_TOL, f"logprob differs from the oracle by {worst:.3f} > {BF16_LOGPROB_TOL}"
    assert err_sum / total <= BF16_LOGPROB_MEAN_TOL, \
        f"mean logprob error {err_sum / total:.3f} > {BF16_LOGPROB_MEAN_TOL}"
    assert_no_leak(eng)
    return {"max_logprob_err": worst, "mean_logprob_err": err_sum / total, "top1_agreement": agree / total,
            "near_ties": ties, "tokens": total}


def bf16_rounded(model):
    """The oracle for bf16: the same weights rounded to bf16, computed in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def check_user_model(model_dir: str, dev: str) -> dict:
    """--model-dir: a real checkpoint, fp32 greedy vs transformers on random token ids."""
    from transformers import AutoModelForCausalLM

    eng = _engine(model_dir, dev, "float32", kv_cache_memory_bytes=256 << 20)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    prompts = random_prompts([5, 31, 64], min(eng.runner.vocab_size, 30000), seed=3)
    res = drive(eng, [(0, f"u{i}", q, None) for i, q in enumerate(prompts)], _greedy(16))
    for i, q in enumerate(prompts):
        assert res[f"u{i}"]["tokens"] == hf_greedy(model, q, 16), f"prompt {i} diverged from transformers"
    return {"prompts": len(prompts)}


def run_engine(rec, opts) -> None:
    import copy

    dev, work = opts.device, Path(opts.work_dir) / "engine"
    if opts.model_dir:
        rec.run(f"--model-dir {opts.model_dir}: fp32 greedy", check_user_model, opts.model_dir, dev)
    torch.manual_seed(0)
    sched = plans(opts.smoke)
    for label, arch, tie, bias, over in model_configs(opts.smoke and not opts.plan):
        model, path = make_hf_model(arch, work / label.replace(" ", "_"), tie=tie, bias_std=bias, **over)
        model = model.to(dev)
        oracles = {"float32": model}
        for ename, (dtype, kw, cases) in engines().items():
            if ename == SPEC_ENGINE and label != model_configs(opts.smoke and not opts.plan)[0][0]:
                continue
            holder = {}

            def start(dtype=dtype, kw=kw, model=model):
                holder["eng"] = build_engine(path, model, dev, dtype, kw)
                return warmup_metrics(holder["eng"])

            if rec.run(f"{label}: {ename} engine start", start) is None:
                continue
            if dtype not in oracles:
                oracles[dtype] = bf16_rounded(copy.deepcopy(model))
            check = check_spec if ename == SPEC_ENGINE else check_fp32 if dtype == "float32" else check_bf16
            for cname, pname in cases:
                rec.run(f"{label}: {ename}: {cname}", check, holder["eng"], oracles[dtype], sched[pname])
            del holder["eng"]
        del model, oracles


# ---- lora ----------------------------------------------------------------------------------------------------


def _lora_setup(work: Path, smoke: bool):
    from harness.lora import ADAPTERS, make_peft_adapter, make_tiny_llama

    base = make_tiny_llama(str(work / "base"), seed=0)
    chosen = [a for a in ADAPTERS if a[0] in ("a1", "a6")] if smoke else ADAPTERS  # smoke: ranks 1 and 3
    root = work / "adapters"
    for i, (name, r, alpha, tm, kw) in enumerate(chosen):
        make_peft_adapter(base, str(root / name), seed=100 + i, r=r, alpha=alpha, target_modules=tm, scale=2.0, **kw)
    return base, root, [a[0] for a in chosen]


def _vs_peft(base, root, prompts, names, res, n):
    from harness.lora import peft_greedy

    for name in dict.fromkeys(names):
        rows = [i for i, x in enumerate(names) if x == name]
        oracle = peft_greedy(base, str(root / name) if name else None, [prompts[i] for i in rows], n)
        for i, (toks, lps, _) in zip(rows, oracle):
            got = res[f"r{i}"]
            assert got["tokens"] == toks, f"row {i} (adapter {name}): {got['tokens']} vs PEFT {toks}"
            err = max(abs(a.logprob - b) for a, b in zip(got["logprobs"], lps))
            assert err <= 2e-4, f"row {i} (adapter {name}): logprob differs from PEFT by {err:.2e}"


def check_lora_mixed(base, root, names, dev, n) -> dict:
    from harness.lora import tiny_llama_config

    eng = _engine(base, dev, "float32", adapter_roots=[str(root)], **LORA_LIMITS)
    groups = []
    orig = eng.adapters.build_lora_meta
    eng.adapters.build_lora_meta = lambda refs, nt: (lambda m: (groups.append(m.num_groups if m else 0), m)[1])(
        orig(refs, nt))
    rows = [None, *names[:2], None, *names[2:], names[0], None]  # adapters interleaved with plain rows
    prompts = random_prompts([4 + 3 * i for i in range(len(rows))], tiny_llama_config().vocab_size, seed=9)
    for name in names:  # resident before the step, so all adapters share one step
        eng.adapters.load(name)
    res = drive(eng, [(0, f"r{i}", q, x) for i, (q, x) in enumerate(zip(prompts, rows))], _greedy(n, logprobs=0))
    assert max(groups) == len(names), f"at most {max(groups)} adapters in one step, {len(names)} expected"
    _vs_peft(base, root, prompts, rows, res, n)
    assert graph_steps(eng) > 0, "no decode step replayed a CUDA graph"
    return {"adapters_in_one_step": max(groups), "rows": len(rows), "graph_steps": graph_steps(eng)}


def check_lora_lifecycle(base, root, names, dev, n) -> dict:
    from harness.lora import tiny_llama_config

    eng = _engine(base, dev, "float32", adapter_roots=[str(root)], **LORA_LIMITS)
    reg = eng.adapters
    prompts = random_prompts([6, 13], tiny_llama_config().vocab_size, seed=10)
    first, second = names[0], names[-1]
    reg.load("hot", first)
    res = drive(eng, [(0, f"r{i}", q, "hot") for i, q in enumerate(prompts)], _greedy(n, logprobs=0))
    _vs_peft(base, root, prompts, [first] * 2, res, n)
    info = reg.reload("hot", second)
    res = drive(eng, [(0, f"r{i}", q, "hot") for i, q in enumerate(prompts)], _greedy(n, logprobs=0))
    _vs_peft(base, root, prompts, [second] * 2, res, n)
    reg.unload("hot")
    try:  # no <root>/hot to fall back on: the name is unknown again
        eng.add_request("after-unload", prompts[0], _greedy(n), "hot")
        raise AssertionError("a request for an unloaded adapter was accepted")
    except RequestError:
        pass
    assert "hot" not in [d["name"] for d in reg.list()] and reg.info()["refs"] == 0
    assert_no_leak(eng)
    return {"reload_version": info["version"]}


def run_lora(rec, opts) -> None:
    from harness.lora import ADAPTERS

    work = Path(opts.work_dir) / "lora"
    base, root, names = _lora_setup(work, opts.smoke and not opts.plan)
    n = 3 if opts.smoke else 8
    ranks = [a[1] for a in ADAPTERS if a[0] in names]
    rec.run(f"{len(names)} adapters (ranks {min(ranks)}-{max(ranks)}) + plain rows in one step vs PEFT",
            check_lora_mixed, base, root, names, opts.device, n)
    rec.run("load / reload / unload under one name vs PEFT", check_lora_lifecycle, base, root, names, opts.device, n)
