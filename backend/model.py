"""Triton Python-based backend `loom`: decoupled streaming LLM serving with per-request LoRA adapters.

Deploy by copying this file to `<backend dir>/loom/model.py` (with the project installed in the
Python environment) and giving models `backend: "loom"`. `execute()` only parses, tokenizes and
enqueues; one AsyncEngine thread steps the engine and ResponseStreamer threads send the responses.
It never raises out of `execute()`: every refusal is an error response with the final flag.
The only module that imports triton_python_backend_utils.
"""
from __future__ import annotations

import copy
import gc
import json
import logging
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from loom.errors import RequestError
from loom.serving.async_engine import AsyncEngine, RequestDelta
from loom.serving.request_parser import AdapterOp, parse_adapter_op, parse_request
from loom.serving.response_streamer import ResponseStreamer
from loom.serving.responses import ResponseBuilder, ResponseState
from loom.serving.serve_config import model_json_warning, parse_model_parameters
from loom.serving.timing_log import TimingLog

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INPUT_NAMES = ("text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
               "return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens")
_INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT32", "dims": [-1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
] + [{"name": n, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for n in INPUT_NAMES[4:]]
_OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
]


class _TritonLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = f"[loom] {self.format(record)}"
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(msg)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(msg)
            else:
                pb_utils.Logger.log_info(msg)
        except Exception:
            pass


log = logging.getLogger("loom")


def _error(message: str, kind: str | None) -> "pb_utils.TritonError":
    codes = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "cancelled": "CANCELLED",
             "timeout": "UNAVAILABLE", "internal": "INTERNAL"}
    code = getattr(pb_utils.TritonError, codes.get(kind or "", "INTERNAL"), None)
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


def _kind_of(e: Exception) -> str:
    if isinstance(e, RequestError):
        return "unavailable" if e.field in ("overload", "server") else "invalid"
    return "internal"


@dataclass
class _Ctx(ResponseState):
    sender: object = None


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, cfg):
        have = cfg.as_dict()
        ins = {i["name"] for i in have.get("input", [])}
        outs = {o["name"] for o in have.get("output", [])}
        for i in _INPUTS:
            if i["name"] not in ins:
                cfg.add_input(i)
        for o in _OUTPUTS:
            if o["name"] not in outs:
                cfg.add_output(o)
        cfg.set_model_transaction_policy(dict(decoupled=True))
        cfg.set_max_batch_size(0)
        return cfg

    def initialize(self, args):
        logging.getLogger("loom").addHandler(_TritonLog())
        logging.getLogger("loom").setLevel(logging.INFO)
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("loom: the model must set model_transaction_policy { decoupled: true }")
        # Bad values raise ConfigError naming the parameter: Triton then refuses to load the model.
        instances = sum(int(g.get("count", 1)) for g in self.model_config.get("instance_group", [])) or 1
        cfg = parse_model_parameters(self.model_config.get("parameters", {}), args["model_repository"], instances)
        ignored = model_json_warning(args["model_repository"], args["model_version"])  # vllm_backend's engine args
        if ignored:
            log.warning(ignored)
        if args.get("model_instance_kind") == "GPU" and cfg.engine.device == "auto":
            cfg.engine.device = f"cuda:{int(args.get('model_instance_device_id', 0))}"
        if cfg.engine.tensor_parallel_size > 1:  # each instance's ranks take GPUs of their own
            from loom.distributed.placement import check_instance_groups
            check_instance_groups(self.model_config.get("instance_group", []),
                                  cfg.engine.tensor_parallel_size // cfg.engine.nnodes, cfg.engine.torch_device.type)
        if not cfg.engine.model:
            from loom.engine.default_model import resolve_default_model
            cfg.engine.model = resolve_default_model()
        from loom.engine.llm_engine import LLMEngine  # heavy import (torch, kernels) only when a model loads

        self.cfg, self.limits = cfg, cfg.limits
        from loom.kernels.cpu_ext import on_a_passing_thread

        # built on a thread of its own: its OpenMP team ends with it, and the loop thread's is the only one
        self.engine = on_a_passing_thread(lambda: LLMEngine(cfg.engine))
        if cfg.engine.adapter_roots or cfg.engine.adapter_sources:  # adapters to serve: the loader boots now, not
            self.engine.adapters.start_loader()  # at the first large load while requests stream (its boot is unpaced)
        # input_ids longer than the engine accepts are refused before they are converted to a list
        self.limits.max_prompt_tokens = cfg.engine.max_prompt_tokens or max(1, self.engine.max_model_len - 1)
        # The loop thread decodes with engine.tokenizer; fast tokenizers are not safe to share across
        # threads, so execute() (encode) and the senders (logprob tokens) get their own copies.
        self.encoder = copy.deepcopy(self.engine.tokenizer)
        self.responses = ResponseBuilder(copy.deepcopy(self.engine.tokenizer))
        self.vocab_size = len(self.encoder)
        self.model_name = args["model_name"]
        self._grammar_lock = threading.Lock()
        self.metrics = None
        names = [n for n, on in (("loom", cfg.options.metrics), ("vllm", cfg.options.vllm_metrics)) if on]
        if names:
            from loom.serving.metrics import LoomMetrics
            labels = {"model": args["model_name"], "version": str(args["model_version"])}
            max_len = self.engine.max_model_len
            cache_info = {"block_size": self.engine.block_manager.block_size,
                          "num_gpu_blocks": self.engine.block_manager.num_blocks}
            self.metrics = LoomMetrics(pb_utils, labels, max_len, names=names,
                                       lora_info_prefix=cfg.options.lora_info_prefix, cache_info=cache_info)
        # Adapters named by requests load on first use from <adapter root>/<name> (the engine's registry).
        self.async_engine = AsyncEngine(self.engine, max_queue_size=cfg.options.max_queue_size,
                                        default_timeout_s=cfg.options.default_request_timeout_s or None,
                                        observer=self.metrics, max_failed_steps=cfg.options.max_failed_steps,
                                        on_unhealthy=self._on_unhealthy)
        self.streamer = ResponseStreamer(self._send, cfg.options.sender_threads)
        path = os.environ.get("LOOM_TIMING_LOG")
        self.timing_log = TimingLog(path) if path else None
        # Everything loaded so far (torch, transformers, the weights' Python objects) lives as long as the model:
        # keep it out of the garbage collector's full passes, which otherwise stall a step for ~0.5 s now and then.
        gc.collect()
        gc.freeze()
        log.info(f"model {args['model_name']} ready: {cfg.engine.model} on {cfg.engine.device}")

    # ------------------------------------------------------------ requests

    def execute(self, requests):
        for request in requests:
            sender = None
            t_arrival = time.monotonic()
            try:
                sender = request.get_response_sender()
                self._enqueue(request, sender, t_arrival)
            except Exception as e:
                if not isinstance(e, RequestError):
                    log.error("execute failed:\n" + traceback.format_exc())
                self._send_error(sender or request.get_response_sender(), str(e) if isinstance(e, RequestError)
                                 else f"internal: {type(e).__name__}: {e}", _kind_of(e))
        return None

    def _enqueue(self, request, sender, t_arrival: float = 0.0) -> None:
        params = request.parameters()
        op = parse_adapter_op(params, self.limits.max_parameters_bytes)
        if op is not None:
            self._adapter_request(op, sender)
            return
        inputs = {}
        for name in INPUT_NAMES:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                inputs[name] = t.as_numpy()
        parsed = parse_request(inputs, params, self.limits)
        t_parsed = time.monotonic()
        if parsed.ids_mode and parsed.params.n > 1:
            raise RequestError("n", "n > 1 needs text_input (output_ids carries one completion)")
        if parsed.params.structured_outputs is not None:
            self._grammars().compile(parsed.params.structured_outputs)  # here, not in the engine loop: cached
        if parsed.ids_mode:
            prompt_ids = parsed.prompt_token_ids
            if max(prompt_ids) >= self.vocab_size:
                raise RequestError("input_ids", f"token ids must be < the vocabulary size {self.vocab_size}")
        else:
            prompt_ids = self.encoder.encode(parsed.prompt, add_special_tokens=False)  # as loom.engine.llm does
            if not prompt_ids:
                raise RequestError("text_input", "the prompt encodes to no tokens")
        ctx = _Ctx(parsed, prompt_ids, t_arrival=t_arrival, t_parsed=t_parsed, t_tokenized=time.monotonic(),
                   sender=sender)
        if self.timing_log is not None:
            ctx.request_id = request.request_id()
        on_output = self.streamer.open(ctx, parsed.stream)
        ctx.t_submitted = time.monotonic()
        self.async_engine.submit(uuid.uuid4().hex, prompt_ids, parsed.params, parsed.lora_name, on_output=on_output,
                                 is_cancelled=sender.is_cancelled, timeout_s=parsed.request_timeout_s)

    def _grammars(self):
        """The engine's structured-output compiler, made here with this thread's tokenizer copy."""
        with self._grammar_lock:
            g = self.engine.grammar_compiler
            if g is None:
                from loom.engine.sample.structured_output import GrammarCompiler
                g = GrammarCompiler(self.encoder, self.engine.runner.vocab_size, sorted(self.engine.eos_token_ids))
                self.engine.grammar_compiler = g
            return g

    # ------------------------------------------------------------ health

    def is_model_ready(self) -> bool:
        """Asked by Triton's readiness endpoints where the Python backend supports it (25.12 and later)."""
        ae = getattr(self, "async_engine", None)
        return ae is not None and ae.health() is None

    def _on_unhealthy(self, reason: str) -> None:
        """The engine can no longer serve: with health_check (vllm_backend's ENABLE_VLLM_HEALTH_CHECK) the model
        unloads itself, so every Triton version reports it not ready (this needs --model-control-mode=explicit)."""
        if not self.cfg.options.health_check:
            log.error(f"engine unhealthy ({reason}); health_check is off: the model stays loaded, refusing requests")
            return

        def unload():
            try:
                pb_utils.unload_model(self.model_name)
                log.error(f"engine unhealthy ({reason}): unloading model {self.model_name}")
            except Exception as e:
                log.error(f"engine unhealthy ({reason}); unloading {self.model_name} failed (it needs "
                          f"--model-control-mode=explicit): {e}")
        threading.Thread(target=unload, name="loom-health-unload", daemon=True).start()

    def _adapter_request(self, op: AdapterOp, sender) -> None:
        # The registry resolves and checks lora_path (one rule for every way an adapter is loaded).
        fut = self.async_engine.adapter_op(op.op, op.name, op.path)

        def done(f):
            try:
                result = f.result()
                path = result.get("path") if op.op in ("load", "reload") else op.path
                body = json.dumps({"adapter_op": op.op, "lora_name": op.name, "lora_path": path, "result": result},
                                  default=str)
                out = pb_utils.Tensor("text_output", np.array([body.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL)
            except Exception as e:
                self._send_error(sender, str(e) if isinstance(e, RequestError)
                                 else f"adapter_op: {type(e).__name__}: {e}", _kind_of(e))
        fut.add_done_callback(done)

    # ------------------------------------------------------------ responses (sender threads)

    def _send_error(self, sender, message: str, kind: str | None) -> None:
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(message, kind)), flags=FINAL)
        except Exception:
            log.error("could not send an error response:\n" + traceback.format_exc())

    def _send(self, ctx: _Ctx, ds: list[RequestDelta]) -> None:
        failed = next((d for d in ds if d.error), None)
        if failed is not None:
            if ctx.parsed.stream and any(d.text or d.token_ids for d in ds) and failed.error_kind != "cancelled":
                ctx.sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(ctx, ds)))
            self._send_error(ctx.sender, failed.error, failed.error_kind)
            return
        final = any(d.finished for d in ds)
        ctx.sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(ctx, ds)), flags=FINAL if final else 0)
        if self.timing_log is not None and not ctx.timing_logged and any(d.token_ids for d in ds):
            ctx.timing_logged = True
            self.timing_log.write(ctx, next((d.timing for d in ds if d.timing is not None), None), time.monotonic())

    def _tensors(self, ctx: _Ctx, ds: list[RequestDelta]) -> list:
        return [pb_utils.Tensor(name, array) for name, array in self.responses.outputs(ctx, ds)]

    def finalize(self):
        """Fail what is still in flight ("server: the model is shutting down"), stop the loop, the senders and
        the metrics thread within shutdown_timeout_s, then drop the engine (weights, KV cache, adapter pools)."""
        cfg = getattr(self, "cfg", None)
        timeout = cfg.options.shutdown_timeout_s if cfg is not None else 10.0
        log.info(f"finalize: stopping the engine loop and the senders (shutdown_timeout_s={timeout:g})")
        deadline = time.monotonic() + timeout
        ae = getattr(self, "async_engine", None)
        if ae is not None:
            ae.shutdown(timeout=timeout)
        if getattr(self, "streamer", None) is not None:
            self.streamer.close(timeout=max(0.1, deadline - time.monotonic()))
        if getattr(self, "metrics", None) is not None:
            self.metrics.close(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        if getattr(self, "timing_log", None) is not None:
            self.timing_log.close()
        self._release_engine(ae)

    def _release_engine(self, ae) -> None:
        engine = getattr(self, "engine", None)
        loop_alive = ae is not None and ae.loop_alive
        if loop_alive:  # a step outlived the timeout: the loop thread still holds the engine; leave it be
            log.warning("finalize: the engine loop did not stop within shutdown_timeout_s; not waiting for it")
        adapters = getattr(engine, "adapters", None)
        if adapters is not None and not loop_alive:
            try:
                adapters.close()  # the background loader thread
            except Exception:
                log.error("closing the adapter registry failed:\n" + traceback.format_exc())
        if engine is not None and not loop_alive:
            try:
                engine.close()  # tensor parallelism: stop the worker processes in order
            except Exception:
                log.error("closing the engine failed:\n" + traceback.format_exc())
        self.engine = self.async_engine = self.streamer = self.metrics = None
        if not loop_alive:
            del engine, adapters, ae
            gc.unfreeze()  # initialize() froze what was loaded; the engine's cycles must be collectable now
            gc.collect()
            try:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception:
                pass
