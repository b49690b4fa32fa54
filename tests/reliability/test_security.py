"""Adapters load only from the configured roots (no `..`, no absolute path elsewhere, no symlink escape),
weights come from safetensors only, and trust_remote_code is never enabled."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from loom.errors import RequestError
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name
from tests.reliability.conftest import REPO

GEN = {"max_tokens": 2, "temperature": 0}


# ------------------------------------------------------------------ unit level

@pytest.mark.parametrize("name", ["../x", "a/../b", "/etc", "/etc/passwd", "..", ".hidden", "a//b", "x\0y", "",
                                  "a" * 300])
def test_adapter_names_cannot_be_paths(name):
    with pytest.raises(RequestError) as ei:
        validate_adapter_name(name)
    assert ei.value.field == "lora_name"


def test_registry_paths_stay_inside_the_roots(adapter_root, outside_dir):
    roots = [str(adapter_root)]
    assert resolve_adapter_path("pirate", roots) == str((adapter_root / "pirate").resolve())
    cases = {
        "../outside": "may not contain '..'",
        "pirate/../../x": "may not contain '..'",
        str(outside_dir / "stolen"): "outside the configured adapter roots",
        "/etc": "outside the configured adapter roots",
        "evil": "resolves outside the configured adapter roots",  # a symlinked folder
        "linkfile": "links outside the adapter roots",  # a symlinked weights file
        "nope": "does not exist",
    }
    for path, msg in cases.items():
        with pytest.raises(RequestError) as ei:
            resolve_adapter_path(path, roots)
        assert msg in str(ei.value), (path, str(ei.value))
    with pytest.raises(RequestError, match="no adapter_roots"):
        resolve_adapter_path("pirate", [])


def test_management_paths_stay_inside_the_roots(adapter_root, outside_dir):
    """Adapter management (load with an explicit lora_path, or the default <root>/<name>) goes through the
    same rule: the registry's."""
    import torch
    from transformers import AutoConfig

    from harness.default_model import ensure_default_model
    from harness.lora import holder_model
    from loom.engine.config import EngineConfig
    from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool

    cfg = AutoConfig.from_pretrained(str(ensure_default_model()))
    row = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(cfg), torch.float32, "cpu")
    reg = AdapterRegistry(EngineConfig(adapter_roots=[str(adapter_root)], lora_memory_bytes=64 * row),
                          holder_model(cfg), "cpu", torch.float32)
    try:
        assert reg.load("robot")["path"] == str((adapter_root / "robot").resolve())
        for path in (str(outside_dir / "stolen"), "../" + outside_dir.name, "/", str(adapter_root / "evil")):
            with pytest.raises(RequestError) as ei:
                reg.load("x", path)
            assert ei.value.field == "lora_path", path
        with pytest.raises(RequestError) as ei:
            reg.load("evil")  # the default <root>/<name> may not be a symlink out either
        assert ei.value.field == "lora_name"
    finally:
        reg.close()


def test_pickle_only_adapter_is_refused(adapter_root):
    from transformers import AutoConfig

    from harness.default_model import ensure_default_model
    from loom.lora.peft_loader import AdapterLoadError, LoraModelSpec, load_peft_adapter

    spec = LoraModelSpec.from_hf_config(AutoConfig.from_pretrained(str(ensure_default_model())))
    import torch
    with pytest.raises(AdapterLoadError) as ei:
        load_peft_adapter(str(adapter_root / "binonly"), "binonly", spec, torch.float32, 64)
    assert "adapter_model.bin" in str(ei.value) and "pickle" in str(ei.value)


def test_trust_remote_code_is_never_enabled():
    """No code path in the project may enable remote code from a model or adapter folder."""
    offenders = []
    for folder in ("backend", "kernels", "scripts"):
        for f in (REPO / folder).rglob("*.py"):
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                for m in re.finditer(r"trust_remote_code\s*[=:]\s*([^,)\s]+)", line):
                    if m.group(1) != "False":
                        offenders.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
                if re.search(r"\*\*\s*\{[^}]*trust_remote_code", line) or "torch.load(" in line \
                        or "pickle.load" in line:
                    offenders.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_weights_are_loaded_from_safetensors_only(tmp_path):
    from loom.models.loader import ModelLoadError, safetensors_files

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        safetensors_files(str(tmp_path))


# ------------------------------------------------------------------ through the server

@pytest.mark.parametrize("lora_name, expect", [
    ("../x", "lora_name: invalid adapter name '../x'"),
    ("/etc", "lora_name: invalid adapter name '/etc'"),
    ("pirate/../../x", "lora_name: invalid adapter name"),
    ("evil", "lora_name: adapter path 'evil' resolves outside the configured adapter roots"),
    ("linkfile", "lora_name: adapter_model.safetensors of adapter path 'linkfile' links outside the adapter roots"),
    ("binonly", "lora_name:"),
])
def test_requests_cannot_name_adapters_outside_the_roots(stream, lora_name, expect):
    from harness.triton_client import make_inputs

    text, err, _ = stream.request(make_inputs("Hello", dict(GEN, lora_name=lora_name)))
    assert err is not None and err.startswith(expect), err
    if lora_name == "binonly":
        assert "safetensors" in err or "adapter_model.bin" in err, err


def test_adapter_ops_cannot_load_from_outside_the_roots(stream, adapter_root, outside_dir):
    for path in (str(outside_dir / "stolen"), "../" + outside_dir.name + "/stolen", "/etc", str(adapter_root / "evil")):
        res, err = stream.adapter_op("load", "x", path)
        assert err is not None and err.startswith("lora_path:"), (path, err)
    res, err = stream.adapter_op("load", "../x")
    assert err is not None and err.startswith(("name:", "lora_name:")), err
    res, err = stream.adapter_op("load", "binonly2", str(adapter_root / "binonly"))
    assert err is not None and "adapter_model.bin" in err, err
    res, err = stream.adapter_op("load", "linky", str(adapter_root / "linkfile"))
    assert err is not None and "links outside the adapter roots" in err, err
    listing, err = stream.adapter_op("list")
    assert err is None and not {"x", "binonly2", "linky", "evil"} & {d["name"] for d in listing["result"]}
    assert Path(outside_dir / "stolen").is_dir()
