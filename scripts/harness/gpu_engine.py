"""gpu_check sections `engine` (the engine vs transformers) and `lora` (multi-LoRA vs PEFT) on the device.

engine: small random models covering GQA groups 1/4/8, head_dim 64/128, Qwen2 q/k/v bias and tied embeddings
(--cpu-smoke: smaller heads). Per model, in float32 the greedy tokens must equal transformers' generate in
three schedules: mixed prefill/decode steps with duplicate prompts and prefix-cache hits, chunked prefill under a
tiny token budget, preemption under a tiny KV budget (each schedule asserts it really happened, and that decode
steps replayed CUDA graphs; --cpu-smoke runs the graph path without capture), and the mixed one again with
cuda_graphs off (every step eager). In bfloat16 the
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


def spy_steps(engine) -> dict:
    """Count steps that mix decodes with prefills, and steps that prefill only part of a prompt (chunks)."""
    stats = {"steps": 0, "mixed": 0, "chunked": 0}
    orig = engine.runner.run

    def run(batch, lora):
        d, seqs = batch.num_decode_seqs, batch.seqs
        stats["steps"] += 1
        stats["mixed"] += 0 < d < len(seqs)
        stats["chunked"] += any(n < q.num_tokens - q.num_computed_tokens
                                for q, n in zip(seqs[d:], batch.num_scheduled_tokens[d:]))
        return orig(batch, lora)

    engine.runner.run = run
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


def graph_steps(eng) -> int:
    return eng.runner.graphs.replays if eng.runner.graphs is not None else 0


def _greedy(n, logprobs=None):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def schedules(smoke: bool) -> dict:
    """name -> (engine kwargs, plan, tokens per request, what the spy/engine must show)."""
    p = random_prompts([40, 7, 20, 5, 50, 37, 9, 20, 25, 18, 30], VOCAB, seed=21)
    a = p[0]
    n = 4 if smoke else 12
    mixed = [(0, "A", a, None), (0, "B", p[1], None), (0, "A-dup", list(a), None),  # a duplicate in the same step
             (3, "A-ext", a + p[3], None), (3, "C", p[2], None),  # arrive while A and B decode: mixed steps
             (n + 2, "A-again", list(a), None)]  # after A finished: hits its cached blocks
    return {
        "mixed prefill/decode + duplicate prompts + prefix hits": ({}, mixed, n, "mixed prefix"),
        "chunked prefill (16-token budget)": (dict(max_num_batched_tokens=16),
                                              [(0, f"c{i}", q, None) for i, q in enumerate(p[4:7])], n, "chunked"),
        "preemption (7 KV blocks)": (dict(kv_cache_memory_bytes=0, enable_prefix_caching=False),
                                     [(0, f"p{i}", q, None) for i, q in enumerate(p[7:11])], 30, "preempt"),
    }


def check_fp32(path, model, dev, sched) -> dict:
    kw, plan, n, must = sched
    if kw.get("kv_cache_memory_bytes") == 0:  # 7 blocks: room for about two of the four requests at a time
        cfg = model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * hd * 4
        kw = dict(kw, kv_cache_memory_bytes=7 * per_block)
    eng = _engine(path, dev, "float32", **kw)
    spy = spy_steps(eng)
    res = drive(eng, plan, _greedy(n))
    oracle = {}
    for _, rid, prompt, _ in plan:
        key = tuple(prompt)
        if key not in oracle:
            oracle[key] = hf_greedy(model, prompt, n)
        assert res[rid]["tokens"] == oracle[key], f"{rid} ({len(prompt)} prompt tokens) diverged from transformers"
    sc = eng.scheduler
    if "mixed" in must:
        assert spy["mixed"] > 0, "no step mixed decodes with prefills"
    if "prefix" in must:
        assert sc.prefix_hit_tokens > 0 and res["A-again"]["cached"] >= 32, "no prefix-cache hit"
    if "chunked" in must:
        assert spy["chunked"] > 0, "no prompt was chunked"
    if "preempt" in must:
        assert sc.num_preemptions > 0, "nothing was preempted"
    if kw.get("cuda_graphs", True):
        assert graph_steps(eng) > 0, "no decode step replayed a CUDA graph"
    assert_no_leak(eng)
    return dict(spy, requests=len(plan), prefix_hit_tokens=sc.prefix_hit_tokens, preemptions=sc.num_preemptions,
                graph_steps=graph_steps(eng))


def check_bf16(path, model, dev, sched) -> dict:
    """Engine in bf16 vs transformers in fp32 on the bf16-rounded weights, teacher-forced on the engine's tokens."""
    kw, plan, n, _ = sched
    eng = _engine(path, dev, "bfloat16", **kw)
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
    for label, arch, tie, bias, over in model_configs(opts.smoke):
        model, path = make_hf_model(arch, work / label.replace(" ", "_"), tie=tie, bias_std=bias, **over)
        model = model.to(dev)
        for name, sched in schedules(opts.smoke).items():
            rec.run(f"{label}: fp32 {name}", check_fp32, path, model, dev, sched)
        kw, plan, n, must = schedules(opts.smoke)["mixed prefill/decode + duplicate prompts + prefix hits"]
        rec.run(f"{label}: fp32 mixed schedule, every step eager (cuda_graphs false)", check_fp32, path, model, dev,
                (dict(kw, cuda_graphs=False), plan, n, must))
        oracle = bf16_rounded(copy.deepcopy(model))
        rec.run(f"{label}: bf16 mixed schedule", check_bf16, path, oracle, dev,
                schedules(opts.smoke)["mixed prefill/decode + duplicate prompts + prefix hits"])
        del model, oracle


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

    eng = _engine(base, dev, "float32", adapter_roots=[str(root)], max_lora_rank=16)
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

    eng = _engine(base, dev, "float32", adapter_roots=[str(root)], max_lora_rank=16)
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
    base, root, names = _lora_setup(work, opts.smoke)
    n = 3 if opts.smoke else 8
    ranks = [a[1] for a in ADAPTERS if a[0] in names]
    rec.run(f"{len(names)} adapters (ranks {min(ranks)}-{max(ranks)}) + plain rows in one step vs PEFT",
            check_lora_mixed, base, root, names, opts.device, n)
    rec.run("load / reload / unload under one name vs PEFT", check_lora_lifecycle, base, root, names, opts.device, n)
