"""PEFT adapters for the LoRA tests and benchmarks, and an HF-based mixed-batch LoRA forward.

The tiny random Llama they are made for is harness.hf_models.make_tiny_llama (re-exported here). An adapter is
either made by PEFT on the model (`make_peft_adapter`) or written directly (`write_raw_adapter`: fast, for many
adapters, benchmarks and malformed cases).

`MixedLoraHF` runs a transformers LlamaForCausalLM whose q/k/v/o/gate/up/down projections get the
multi-LoRA delta from the registry's pools through the real kernels (`kernels.lora_shrink/expand`),
with tokens grouped by `build_lora_meta` — i.e. everything of the LoRA path except the engine.
"""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import torch
from torch import nn

from harness.hf_models import make_tiny_llama, tiny_llama_config  # noqa: F401  (the LoRA tests' tiny Llama)
from loom.lora import LoraModelSpec, build_lora_meta

PROJ_GROUP = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}


def load_hf(model_dir: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def make_peft_adapter(model_dir: str, out_dir: str, seed: int, r: int = 4, alpha: float = 8,
                      target_modules=("q_proj", "v_proj"), scale: float = 1.0, **lora_kw) -> str:
    """Save a PEFT adapter with non-zero B (PEFT initialises B to zero): harness.hf_models.make_peft_adapter with
    the defaults of the Llama LoRA tests."""
    from harness.hf_models import make_peft_adapter as make

    return make(model_dir, out_dir, seed, r=r, alpha=alpha, scale=scale, target_modules=target_modules, **lora_kw)


def write_raw_adapter(out_dir: str, cfg, seed: int, r: int, alpha: float, target_modules, dtype=torch.float32,
                      extra_config: dict | None = None, extra_tensors: dict | None = None, scale: float = 1.0,
                      b_scale: float | None = None) -> str:
    """Write a PEFT-format adapter directly (fast; for many adapters and malformed cases): every layer of `cfg` (a
    transformers config, or any object with its attributes), A ~ N(0, scale^2 / in_features) and
    B ~ N(0, b_scale^2 / r) (b_scale: scale when None), drawn layer by layer, projection by projection, from
    one generator seeded with `seed`."""
    from safetensors.torch import save_file

    spec = LoraModelSpec.from_hf_config(cfg)
    g = torch.Generator().manual_seed(seed)
    b_scale = scale if b_scale is None else b_scale
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj in target_modules:
            block = PROJ_GROUP[proj][0]
            in_f, out_f = spec.proj_shape(proj)
            pre = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(r, in_f, generator=g) * scale / in_f ** 0.5).to(dtype)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out_f, r, generator=g) * b_scale / r ** 0.5).to(dtype)
    tensors.update(extra_tensors or {})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(target_modules),
            "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM"}
    conf.update(extra_config or {})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    return out_dir


def make_bench_adapters(model_dir: str, root: Path, n: int, rank: int, seed: int = 0) -> list[str]:
    """`n` random rank-`rank` adapters of the model on q_proj and v_proj, root/bench-lora-000 ... (B non-zero, so
    they change the output; adapter a drawn from seed * 100003 + a) -> their names (scripts/bench_serving.py)."""
    cfg = types.SimpleNamespace(**json.loads((Path(model_dir) / "config.json").read_text()))
    names = [f"bench-lora-{a:03d}" for a in range(n)]
    for a, name in enumerate(names):
        write_raw_adapter(str(Path(root) / name), cfg, seed=seed * 100003 + a, r=rank, alpha=2 * rank,
                          target_modules=("q_proj", "v_proj"), b_scale=0.5,
                          extra_config={"base_model_name_or_path": str(model_dir)})
    return names


class _Holder(nn.Module):
    def __init__(self, in_features, output_sizes):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.lora_a = None
        self.lora_b = None


class _Holders(nn.Module):
    """Stands in for an engine model: only its LoRA-capable modules (model.layers.i.self_attn.qkv_proj ...)."""

    def __init__(self, cfg):
        super().__init__()
        spec = LoraModelSpec.from_hf_config(cfg)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        self._modules_by_group = {}
        for i in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.mlp = nn.Module()
            for g in spec.groups:
                block, name = g.path.split(".")
                holder = _Holder(g.in_features, g.output_sizes)
                setattr(getattr(layer, block), name, holder)
                self._modules_by_group[(i, g.name)] = holder
            self.model.layers.append(layer)

    def lora_modules(self) -> dict:
        return dict(self._modules_by_group)


def holder_model(cfg) -> nn.Module:
    """A module tree with the engine's LoRA module names/attributes and its `lora_modules()`."""
    return _Holders(cfg)


class MixedLoraHF:
    """HF Llama + registry pools: batched forward/generation where each sequence has its own adapter."""

    def __init__(self, hf_model, holders: nn.Module):
        from loom.kernels import lora_apply

        self.hf = hf_model
        self.holders = holders
        self.refs = None
        self.meta = None
        self._lora_apply = lora_apply
        for i, layer in enumerate(hf_model.model.layers):
            for proj, (block, group, si) in PROJ_GROUP.items():
                mod = getattr(getattr(layer, block), proj)
                holder = getattr(getattr(holders.model.layers[i], block), group)
                mod.register_forward_hook(self._make_hook(holder, si))
        hf_model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def _pre_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        B, L = ids.shape
        self.meta = build_lora_meta(self.refs, [L] * B, ids.device) if self.refs is not None else None

    def _make_hook(self, holder, si):
        def hook(mod, inp, out):
            if self.meta is None or holder.lora_a is None:
                return out
            x = inp[0].reshape(-1, inp[0].shape[-1])
            y = out.reshape(-1, out.shape[-1]).clone()
            lo = sum(holder.output_sizes[:si])
            hi = lo + holder.output_sizes[si]
            a = holder.lora_a[si:si + 1]
            b = holder.lora_b[:, lo:hi]
            self._lora_apply(x.contiguous(), y, a, b.contiguous(), [0, hi - lo], self.meta)
            return y.reshape(out.shape)
        return hook

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, refs):
        self.refs = refs
        try:
            return self.hf(input_ids=input_ids).logits
        finally:
            self.refs = None

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, refs, max_new_tokens: int = 8):
        self.refs = refs
        try:
            out = self.hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            return out.sequences[:, input_ids.shape[1]:], torch.stack(out.scores, 1)
        finally:
            self.refs = None


@torch.no_grad()
def peft_generate(model_dir: str, adapter_dir: str | None, input_ids: torch.Tensor, max_new_tokens: int = 8):
    """Oracle: HF (+ PEFT adapter, one at a time) greedy generation -> (tokens, per-step logits)."""
    model = load_hf(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, input_ids.shape[1]:], torch.stack(out.scores, 1)


@torch.no_grad()
def peft_greedy(model_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int = 8):
    """Oracle without generate(): full-recompute greedy decoding with HF (+ PEFT adapter). No eos handling.
    Returns per prompt (tokens, logprobs of the chosen tokens, log_softmax rows)."""
    model = load_hf(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        toks, lps, rows = [], [], []
        for _ in range(max_new_tokens):
            lsm = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            t = int(lsm.argmax())
            toks.append(t)
            lps.append(float(lsm[t]))
            rows.append(lsm)
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
        out.append((toks, lps, torch.stack(rows)))
    return out


# The mixed set of adapters both PEFT-parity tests use: ranks 1-16, different targets and options.
ADAPTERS = [  # name, r, alpha, targets, extra LoraConfig kwargs
    ("a1", 1, 2, ["q_proj"], {}),
    ("a2", 2, 4, ["k_proj", "v_proj"], {}),
    ("a3", 4, 8, ["o_proj"], {"use_rslora": True}),
    ("a4", 8, 8, ["gate_proj", "up_proj"], {}),
    ("a5", 16, 32, ["down_proj"], {}),
    ("a6", 3, 5, "all-linear", {}),
    ("a7", 6, 12, ["q_proj", "v_proj", "down_proj"],
     {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"v_proj": 3}}),
    ("a8", 5, 7, ["up_proj", "k_proj"], {"layers_to_transform": [1]}),
    ("a9", 12, 6, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    ("a10", 4, 8, ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"], {}),  # PEFT's dotted-suffix entries
]


# ---- many adapters under real traffic (bench_lora --adapters; tests/lora/test_lora_scheduling) -----------------

def popularity_weights(spec: str, n: int) -> list[float]:
    """`uniform` or `zipf:A` -> the weights of adapters 0..n-1, adapter 0 the most popular (rank k: 1 / k^A)."""
    if spec == "uniform":
        return [1.0] * n
    kind, _, a = spec.partition(":")
    if kind != "zipf" or not a:
        raise ValueError(f"--popularity must be uniform or zipf:A, got {spec!r}")
    return [1.0 / (k + 1) ** float(a) for k in range(n)]


def shift_ranks(ranks: list[int], n: int, at: float) -> list[int]:
    """A popularity shift: from request int(at * len) on, adapter k's share goes to adapter (k + n // 2) % n, so the
    hot set of the second part is adapters no request of the first part favoured (at 0: no shift)."""
    cut = int(at * len(ranks)) if at > 0 else len(ranks)
    return ranks[:cut] + [(k + n // 2) % n for k in ranks[cut:]]


def recovery_s(token_times: list[tuple[float, int]], shift_t: float, end_t: float, window_s: float,
               level: float = 0.9) -> tuple[float, float, float | None]:
    """Throughput in windows of `window_s` seconds: (the median window rate before `shift_t`, the lowest after it, and
    the seconds from `shift_t` until the rate stays at >= `level` x that median in every later window that ends by
    `end_t` (the last arrival: after it the rate falls because requests run out) - 0.0 if it never dropped, None if
    it never recovers)."""
    import statistics

    def rate(t: float) -> float:
        return sum(k for at, k in token_times if t <= at < t + window_s) / window_s

    before = [rate(t) for t in _frange(0.0, shift_t - window_s, window_s)]
    after = [(t, rate(t)) for t in _frange(shift_t, end_t - window_s, window_s)]
    if not before or not after:
        raise ValueError(f"--window-s {window_s} leaves no whole window before or after the shift")
    base = statistics.median(before)
    low = [t for t, r in after if r < level * base]
    if not low:
        return base, min(r for _, r in after), 0.0
    last = max(low)
    if last == after[-1][0]:
        return base, min(r for _, r in after), None
    return base, min(r for _, r in after), last + window_s - shift_t


def _frange(lo: float, hi: float, step: float) -> list[float]:
    """lo, lo + step, ... <= hi (window starts)."""
    n = int((hi - lo) // step) + 1 if hi >= lo else 0
    return [lo + i * step for i in range(n)]


def admission_bound(arrival: list[int], first: list[int], last: list[int], w: int) -> list[int]:
    """The queue time (steps) loom.engine.core.scheduler's rule guarantees each request r, given when every request was
    queued, got its first token and ended (steps; index order = queue order): from step a_r + W on, only requests
    queued before r or admitted before that step can hold it back, so r is admitted at a_r + W or the step after the
    last of those ends, whichever is later."""
    out = []
    for r, a in enumerate(arrival):
        ahead = [last[q] + 1 for q in range(len(arrival)) if q < r or first[q] < a + w]
        out.append(max(w, max(ahead, default=0) - a))
    return out


def last_load_seq(loads) -> int:
    """The number of the newest load in the registry's recent loads (LoraStats.loads), 0 if none: the loads after it
    are a later run's. (Their count would not do: the registry keeps only the most recent RECENT_LOADS.)"""
    return max((x.seq for x in loads), default=0)


def run_arrivals(eng, prompts: list[list[int]], names: list[str | None], arrivals: list[float], params) -> dict:
    """Drive an engine in real time: request i (prompts[i], adapter names[i]) is added `arrivals[i]` s after the
    start. -> per request: steps and times of its arrival, first token and end, the tier its adapter was in when it
    arrived (`tier_of`, before the request asked for it); per step: its seconds, the requests it ran, whether it only
    decoded (no prompt: no first token came out of it), whether a read from disk was in flight and the distinct
    adapters it ran; the wall time and tokens made."""
    import time

    reg = eng.adapters
    n = len(prompts)
    req = {k: [None] * n for k in ("arrival_step", "first_step", "last_step", "arrival_t", "first_t", "tier")}
    steps: list[tuple[float, int, bool, bool]] = []
    token_times: list[tuple[float, int]] = []  # (seconds from the start, tokens) of each step that made tokens
    tokens = i = step = 0
    t0 = time.perf_counter()
    while i < n or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        if i < n and not eng.has_unfinished_requests() and arrivals[i] > now:
            time.sleep(arrivals[i] - now)  # idle until the next arrival
            now = arrivals[i]
        while i < n and arrivals[i] <= now:
            req["tier"][i] = (reg.tier_of(names[i]) or "disk") if names[i] else "base"
            eng.add_request(str(i), prompts[i], params, names[i])
            req["arrival_step"][i], req["arrival_t"][i] = step, arrivals[i]
            i += 1
        loading = reg.has_pending_loads()
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        ids = eng.last_step_request_ids
        batch, distinct = len(ids), len({names[int(r)] for r in ids if names[int(r)]})
        steps.append((te - ts, batch, batch > 0 and all(req["first_step"][int(o.request_id)] is not None
                                                         for o in outs), loading, distinct))
        made = sum(len(o.new_token_ids) for o in outs)
        if made:
            token_times.append((te - t0, made))
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id}: {o.error}")
            k = int(o.request_id)
            tokens += len(o.new_token_ids)
            if req["first_step"][k] is None and o.new_token_ids:
                req["first_step"][k], req["first_t"][k] = step, te - t0
            if o.finished:
                req["last_step"][k] = step
        step += 1
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "requests": req, "steps": steps,
            "token_times": token_times}
