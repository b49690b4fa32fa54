"""Kernel launches of one decode step, per step and per decoder layer, counted from outside
(loom.kernels.launch_counter): a tiny random 4-layer Llama served by the engine with every op on its Triton path
(LOOM_FORCE_TRITON=1, run by the Triton interpreter on CPU) and the GEMMs as F.linear (LOOM_CPU_KERNELS=0), one
decode step of 4 sequences, without LoRA and with an all-linear adapter on half of them. What it counts is what
the same step launches on a GPU: the Triton launchers run as they would, and the dispatcher sees the same ops.

    python scripts/launch_count.py [--layers 4] [--seqs 4]

Columns: triton (Triton kernels), gemm (mm / addmm), copy (copy_ / clone: .contiguous() materialisations),
other (any other PyTorch kernel), total. "outside" is the embedding, the final norm and the logits.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (a GPU run may set it to 0)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, when imported as a module

import torch  # noqa: E402

KINDS = ("triton", "gemm", "copy", "other")


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_model(root: str, layers: int = 4) -> tuple[str, str]:
    """A tiny random Llama of `layers` layers and a PEFT adapter on every linear layer -> (model dir, adapter root)."""
    from harness.hf_models import DEFAULT_PEFT_TARGETS, make_hf_model, make_peft_adapter

    _, path = make_hf_model("llama", root, num_hidden_layers=layers)
    adapters = os.path.join(root, "adapters")
    make_peft_adapter(path, os.path.join(adapters, "a"), seed=3, r=8, alpha=16, **DEFAULT_PEFT_TARGETS)
    return path, adapters


def count_decode_step(model_dir: str, adapter_root: str, lora: bool, seqs: int = 4):
    """The LaunchCounter of the first step that decodes exactly `seqs` sequences (with an adapter on every other
    one if `lora`), its records labelled by decoder layer index (None: outside the layers)."""
    from harness.hf_models import random_prompts
    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams
    from loom.kernels.launch_counter import LaunchCounter
    from loom.layers.forward_context import get_forward_context

    with _env(LOOM_FORCE_TRITON="1", LOOM_CPU_KERNELS="0"):
        llm = LLM(model_dir, block_size=16, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                  adapter_roots=[adapter_root], max_lora_rank=8)
        runner = llm.engine.runner
        forward, counted = runner.forward, []
        current: list = []  # the counter of the step being counted, if any

        def labelled(i):
            def pre(*_):
                if current:
                    current[0].label = i

            def post(*_):
                if current:
                    current[0].label = None

            return pre, post

        for i, layer in enumerate(runner.model.model.layers):
            pre, post = labelled(i)
            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)

        def counting_forward(ids, positions, logits_indices):
            ctx = get_forward_context()
            wanted = (not counted and ctx.num_decode_seqs == seqs and ctx.prefill is None
                      and (ctx.lora is not None) == lora)
            if not wanted:
                return forward(ids, positions, logits_indices)
            with LaunchCounter() as c:
                current.append(c)
                try:
                    out = forward(ids, positions, logits_indices)
                finally:
                    current.clear()
            counted.append(c)
            return out

        runner.forward = counting_forward
        prompts = random_prompts([5, 9, 12, 7, 3, 8, 10, 6][:seqs], 320, seed=11)
        names = [("a" if i % 2 == 0 else None) if lora else None for i in range(seqs)]
        if lora:  # loaded before the steps, so the prefill already carries it and the next step decodes all four
            llm.engine.adapters.load("a")
        # two tokens: the prefill's, then the decode step counted
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), lora_names=names)
        assert all(o.error is None for o in outs), [o.error for o in outs]
    if not counted:
        raise RuntimeError(f"no step decoded exactly {seqs} sequences")
    return counted[0]


def table(c, layers: int) -> list[str]:
    rows = [f"  {'':<12}" + "".join(f"{k:>8}" for k in KINDS) + f"{'total':>8}"]

    def row(name, label):
        n = c.by_kind(label)
        rows.append(f"  {name:<12}" + "".join(f"{n[k]:>8}" for k in KINDS) + f"{sum(n.values()):>8}")

    for i in range(layers):
        row(f"layer {i}", i)
    row("outside", None)
    row("step", ...)
    rows.append("  layer 0: " + " ".join(f"{k}:{n}" for _, k, n in (r for r in c.records if r[0] == 0)))
    return rows


def per_layer_max(c, layers: int) -> dict:
    """The largest count of each kind (and in total) over the layers."""
    out = {k: max(c.count(i, k) for i in range(layers)) for k in KINDS}
    out["total"] = max(c.count(i) for i in range(layers))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=4)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        model_dir, adapters = make_model(root, args.layers)
        for lora in (False, True):
            c = count_decode_step(model_dir, adapters, lora, args.seqs)
            print(f"decode step of {args.seqs} sequences, {args.layers}-layer Llama, every op on its Triton path, "
                  f"{'LoRA (all-linear, r=8) on every other sequence' if lora else 'no LoRA'}:")
            print("\n".join(table(c, args.layers)))
            m = per_layer_max(c, args.layers)
            print(f"  per layer: {m['total']} launches ({m['copy']} copies)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
