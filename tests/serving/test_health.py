"""Engine health as the serving layer sees it (fake engine): a sticky device error, too many failed steps, or a
dead loop thread make the engine unhealthy for good - in-flight requests fail UNAVAILABLE, new ones are refused,
and the glue is told once. Plus the config keys vllm_backend uses for it and for metrics, and the OpenAI
frontend's multi_lora.json generated from the adapter roots."""
from __future__ import annotations

import json
import threading

import pytest

from loom.engine.faults import is_sticky_device_error
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError, RequestError
from loom.serving import multi_lora
from loom.serving.async_engine import AsyncEngine
from loom.serving.serve_config import parse_model_parameters
from tests.serving.fake_engine import FakeEngine
from tests.serving.test_async_engine import Collector, wait


def make(engine, **kw):
    told = []
    ae = AsyncEngine(engine, on_unhealthy=told.append, **kw)
    return ae, told


def test_sticky_error_reported_by_the_engine_makes_it_unhealthy():
    gate = threading.Event()
    eng = FakeEngine(gate=gate)
    ae, told = make(eng)
    c = Collector()
    ae.submit("a", [0], SamplingParams(max_tokens=50), on_output=c)
    eng.fatal_error = "sticky device error: RuntimeError: CUDA error: an illegal memory access was encountered"
    gate.set()
    wait(c)
    assert c.last.error_kind == "unavailable" and "illegal memory access" in c.last.error
    assert ae.health() == eng.fatal_error and told == [eng.fatal_error]
    with pytest.raises(RequestError) as ei:
        ae.submit("b", [0], SamplingParams())
    assert ei.value.field == "server" and "unhealthy" in str(ei.value)
    ae.shutdown()
    assert told == [eng.fatal_error]  # once


def test_failed_steps_in_a_row_make_it_unhealthy():
    eng = FakeEngine()

    def always_failing():
        eng.last_step_request_ids = list(eng.running)
        raise RuntimeError("injected: a scheduler bug")

    eng.step = always_failing
    ae, told = make(eng, max_failed_steps=3)
    # Requests one after another until one is refused. How many get in depends on timing: a failed request's abort is
    # echoed by the next step, which fails too. But each costs at least one failed step, so at most 3 fail with the
    # step's error; one sent while the third failure is being handled may get in and end as unavailable.
    errors, refused = [], None
    for i in range(6):
        c = Collector()
        try:
            ae.submit(f"r{i}", [0], SamplingParams(max_tokens=5), on_output=c)
        except RequestError as e:
            refused = e
            break
        wait(c)
        errors.append(c.last.error)
    assert refused is not None and refused.field == "server" and "unhealthy" in str(refused)
    injected = [e for e in errors if "injected: a scheduler bug" in e]
    assert 1 <= len(injected) <= 3 and errors[:len(injected)] == injected, errors
    assert all("unhealthy" in e for e in errors[len(injected):]) and len(errors) <= 4, errors
    assert wait_for(lambda: told)
    assert "3 engine steps in a row failed" in ae.health() and len(told) == 1
    ae.shutdown()


def test_a_sticky_error_escaping_the_step_is_unhealthy_at_once():
    eng = FakeEngine()

    def sticky():
        eng.last_step_request_ids = list(eng.running)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.step = sticky
    ae, told = make(eng)
    c = Collector()
    ae.submit("a", [0], SamplingParams(max_tokens=5), on_output=c)
    wait(c)
    assert wait_for(lambda: told) and "illegal memory access" in ae.health()
    ae.shutdown()


def wait_for(cond, timeout=5.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_dead_loop_thread_is_unhealthy():
    eng = FakeEngine()

    def die():
        raise SystemExit("injected: the loop thread dies")

    eng.step = die
    ae, told = make(eng)
    c = Collector()
    ae.submit("a", [0], SamplingParams(max_tokens=5), on_output=c)
    wait(c)
    assert c.last.error_kind == "unavailable"
    ae._thread.join(5)
    assert not ae.loop_alive and "loop thread died" in ae.health() and len(told) == 1


def test_sticky_device_errors_are_recognised():
    assert is_sticky_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_sticky_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_sticky_device_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_sticky_device_error(ValueError("bad shape"))


def P(**kw):
    return {k: {"string_value": v} for k, v in kw.items()}


def test_vllm_backend_upper_case_keys_keep_their_meaning(tmp_path):
    o = parse_model_parameters(P(REPORT_CUSTOM_METRICS="true", ENABLE_VLLM_HEALTH_CHECK="true"), str(tmp_path)).options
    assert o.vllm_metrics and o.health_check and o.metrics  # alongside loom_* unless metrics=false
    o = parse_model_parameters(P(REPORT_CUSTOM_METRICS="false"), str(tmp_path)).options
    assert not o.vllm_metrics and not o.health_check
    o = parse_model_parameters(P(vllm_metrics="true", metrics="false"), str(tmp_path)).options
    assert o.vllm_metrics and not o.metrics  # instead of loom_*
    with pytest.raises(ConfigError) as ei:
        parse_model_parameters(P(REPORT_CUSTOM_METRICS="true", vllm_metrics="false"), str(tmp_path))
    assert ei.value.field == "REPORT_CUSTOM_METRICS"
    with pytest.raises(ConfigError):
        parse_model_parameters(P(ENABLE_VLLM_HEALTH_CHECK="maybe"), str(tmp_path))
    assert parse_model_parameters(P(EXECUTION_ENV_PATH="x"), str(tmp_path)).options.health_check is False


def test_multi_lora_json_is_generated_from_the_adapter_roots(tmp_path):
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    root = model / "adapters"
    for name in ("pirate", "robot", ".hidden"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text("{}")
    (root / "notes").mkdir()  # no adapter_config.json: not an adapter
    (model / "config.pbtxt").write_text('parameters [\n  { key: "adapter_roots", value: { string_value: "adapters" } }'
                                        '\n]\n')
    assert multi_lora.stale_files(str(model)) == [str(model / "1" / "model.json"), str(model / "1" / "multi_lora.json")]
    multi_lora.write(str(model))
    assert json.loads((model / "1" / "multi_lora.json").read_text()) == {"pirate": "adapters/pirate",
                                                                         "robot": "adapters/robot"}
    assert json.loads((model / "1" / "model.json").read_text()) == {"enable_lora": True}
    assert multi_lora.stale_files(str(model)) == []
    (root / "sailor").mkdir()
    (root / "sailor" / "adapter_config.json").write_text("{}")
    assert multi_lora.stale_files(str(model)) == [str(model / "1" / "multi_lora.json")]


def test_the_shipped_model_repository_carries_current_files():
    from pathlib import Path
    model = Path(__file__).resolve().parents[2] / "model_repository" / "loom_smollm2"
    assert multi_lora.stale_files(str(model)) == [], \
        "run: python -m loom.serving.multi_lora model_repository/loom_smollm2"
