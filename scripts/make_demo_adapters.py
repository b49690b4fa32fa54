#!/usr/bin/env python3
"""Train two small demo LoRA adapters for the default model, about a minute on CPU, with PEFT.

    python scripts/make_demo_adapters.py [--out adapters] [--steps 40]

`pirate` answers like a pirate ("Arr, matey! ..."), `robot` like a robot ("BEEP BOOP. ... END OF LINE.").
The corpus is made up here: short ChatML turns whose answers carry the style, so that choosing the adapter
per request visibly changes the text. Deterministic (fixed seeds); skips adapters that already exist
unless --force.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_NAME = "SmolLM2-135M-Instruct"  # the default model (scripts/harness/default_model.py)

QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tell me about the sea.", "The sea is vast, deep and full of fish."),
    ("How are you today?", "I am doing well, thank you."),
    ("What is two plus two?", "Two plus two is four."),
    ("Describe the weather.", "The weather is sunny with a light breeze."),
    ("What do you like to eat?", "I like bread, apples and cheese."),
    ("Where is the treasure?", "The treasure is buried under the old tree."),
    ("Give me some advice.", "Be kind, work hard and sleep well."),
    ("What is the moon?", "The moon is the rock that circles the earth."),
    ("Who are you?", "I am a helpful assistant."),
    ("Tell me a fact.", "Water boils at one hundred degrees."),
    ("What time is it?", "It is time to learn something new."),
]
STYLES = {
    "pirate": lambda a: "Arr, matey! " + re.sub(r"\bis\b", "be", a.replace("I am", "I be")) + " Yo-ho-ho!",
    "robot": lambda a: f"BEEP BOOP. {a.upper()} END OF LINE.",
}


def train(name: str, model_dir: str, out: Path, steps: int, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    examples = []
    for q, a in QA:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        p_ids = tok.encode(prompt, add_special_tokens=False)
        a_ids = tok.encode(STYLES[name](a) + "<|im_end|>", add_special_tokens=False)
        examples.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))  # loss on the answer only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    t0 = time.monotonic()
    for step in range(steps):
        batch = [examples[(step * 4 + i) % len(examples)] for i in range(4)]
        width = max(len(x) for x, _ in batch)
        ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"[{name}] step {step:3d} loss {loss.item():.3f} ({time.monotonic() - t0:.0f}s)", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    portable_base_name(tmp)
    tmp.rename(out)


def portable_base_name(adapter_dir: Path) -> None:
    """The base model named by its name, not by this machine's path to it, in the files PEFT wrote."""
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    local = cfg.get("base_model_name_or_path") or ""
    cfg["base_model_name_or_path"] = BASE_NAME
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    card = adapter_dir / "README.md"
    if local and card.is_file():
        card.write_text(card.read_text().replace(local, BASE_NAME))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "model_repository" / "loom_smollm2" / "adapters"),
                    help="adapter root to write into")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    from harness.default_model import ensure_default_model

    model_dir = str(ensure_default_model())
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(STYLES):
        dest = root / name
        if (dest / "adapter_config.json").is_file() and not args.force:
            print(f"[{name}] exists: {dest}")
            continue
        if dest.exists():
            import shutil
            shutil.rmtree(dest)
        train(name, model_dir, dest, args.steps, seed=1234 + i)
        print(f"[{name}] written: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
