"""The docs cannot drift: docs/CONFIGURATION.md's table is the dataclasses' fields, and every relative link in
README.md and docs/ (with its #anchor) resolves inside the repository."""
from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from loom.engine.config import EngineConfig
from loom.serving.serve_config import VLLM_BACKEND_KEYS, ServeOptions

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = ROOT / "docs" / "CONFIGURATION.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CLASSES = {cls.__name__: cls for cls in (EngineConfig, ServeOptions)}

# | `Class.field` | `type` | `default as JSON` | `key`[, `alias`] | meaning |
ROW = re.compile(r"^\| `(\w+)\.(\w+)` \| `([^`]+)` \| `([^`]*)` \| ((?:`\w+`(?:, )?)+) \| .+ \|$")


def config_rows(text: str) -> list[tuple[str, str, str, str, list[str]]]:
    """(class, field, type, default cell, config.pbtxt keys) per row of the configuration table."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        m = ROW.match(line)
        assert m, f"docs/CONFIGURATION.md: a table row not in the table's format: {line[:120]}"
        cls, name, typ, default, keys = m.groups()
        rows.append((cls, name, typ, default, re.findall(r"`(\w+)`", keys)))
    return rows


def config_problems(rows) -> list[str]:
    """What in the table disagrees with the dataclasses (empty: nothing)."""
    actual = {(c, f.name): f for c, cls in CLASSES.items() for f in fields(cls)}
    documented = [(cls, name) for cls, name, *_ in rows]
    problems = [f"{c}.{n}: documented twice" for c, n in sorted(set(documented)) if documented.count((c, n)) > 1]
    problems += [f"{c}.{n}: not documented" for c, n in sorted(set(actual) - set(documented))]
    problems += [f"{c}.{n}: no such field" for c, n in sorted(set(documented) - set(actual))]
    for cls, name, typ, default, keys in rows:
        f = actual.get((cls, name))
        if f is None:
            continue
        if typ != f.type:
            problems.append(f"{cls}.{name}: documented type {typ}, the dataclass says {f.type}")
        real = f.default_factory() if f.default is MISSING else f.default
        doc = json.loads(default)
        # the same type too: JSON 0 for a False default, or 10 for 10.0, would hide a changed type
        if type(doc) is not type(real) or doc != real:
            problems.append(f"{cls}.{name}: documented default {default}, the dataclass says {real!r}")
        # parse_model_parameters reads every field by its name, plus vllm_backend's upper-case aliases
        expected = [name, *sorted(k for k, v in VLLM_BACKEND_KEYS.items() if v == name)]
        if keys != expected:
            problems.append(f"{cls}.{name}: config.pbtxt keys {keys}, the parser reads {expected}")
    return problems


def test_configuration_table_matches_the_dataclasses():
    rows = config_rows(CONFIG_DOC.read_text())
    assert len(rows) == sum(len(fields(cls)) for cls in CLASSES.values())
    assert config_problems(rows) == []


def test_configuration_check_catches_drift():
    rows = config_rows(CONFIG_DOC.read_text())
    drifted = [r for r in rows if r[1] != "seed"]  # a field left out
    drifted = [(c, n, t, "32" if n == "block_size" else d, k) for c, n, t, d, k in drifted]  # a changed default
    drifted = [(c, n, "float" if n == "max_n" else t, d, k) for c, n, t, d, k in drifted]  # a changed type
    drifted = [(c, n, t, "1" if n == "cuda_graphs" else d, k) for c, n, t, d, k in drifted]  # 1 for true
    drifted = [(c, n, t, d, ["REPORT_CUSTOM_METRICS"] if n == "vllm_metrics" else k) for c, n, t, d, k in drifted]
    drifted.append(("EngineConfig", "pipeline_parallel_size", "int", "1", ["pipeline_parallel_size"]))
    found = config_problems(drifted)
    assert [p.split(":")[0] for p in found] == [
        "EngineConfig.seed", "EngineConfig.pipeline_parallel_size", "EngineConfig.block_size",
        "EngineConfig.cuda_graphs", "ServeOptions.vllm_metrics", "ServeOptions.max_n"], found


# ---- links ---------------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where [x](y) is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_links(text: str, base: Path) -> list[str]:
    """Relative link targets of a markdown text (in folder `base`) that are no file or folder of the repository,
    or name an anchor their markdown file does not have."""
    broken = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve() if path else None
        if dest is not None and (not dest.is_relative_to(ROOT) or not dest.exists()):
            broken.append(target)
        elif anchor and dest is not None and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_in_the_repository(md):
    assert broken_links(md.read_text(), md.parent) == []


def test_link_check_catches_dead_links():
    text = ("[a](../shared/PEERS.md) [b](docs/CONFIGURATION.md#environment) [c](docs/CONFIGURATION.md#nope) "
            "[d](https://example.com/x.md) `[e](shared/x.md)` [f](docs/benchmarks/history/)")
    assert broken_links(text, ROOT) == ["../shared/PEERS.md", "docs/CONFIGURATION.md#nope"]
