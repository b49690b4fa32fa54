"""Engine configuration: one dataclass, validated once, with errors that say which field to fix."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from loom.engine.spec_decode.config import SpeculativeConfig
from loom.errors import ConfigError
from loom.kernels.kv_fp8 import KV_CACHE_DTYPES, KV_FP8_STORAGE

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str = ""  # HF model directory; empty = the default model (built offline once)
    dtype: str = "auto"  # auto: the checkpoint's dtype (bf16/fp16) on CUDA; on CPU see resolve_dtype
    device: str = "auto"  # auto: cuda if available else cpu
    block_size: int = 16
    # KV memory: a byte budget on CPU; on CUDA a fraction of total GPU memory (after profiling) unless bytes given.
    kv_cache_memory_bytes: int = 0  # 0 = derive (CPU: 1 GiB)
    # auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3, vLLM's names): e4m3 codes, one byte an element (twice
    # the tokens of a 16-bit cache in the same bytes), with each layer's K and V scales from the checkpoint (else 1.0)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 = model's max_position_embeddings
    enable_prefix_caching: bool = True
    # LoRA
    adapter_roots: list[str] = field(default_factory=list)
    max_lora_rank: int = 64
    lora_memory_bytes: int = 256 << 20  # device pools of rank rows of the attention / dense MLP layers
    # Element type of the adapter pools: auto = the model's dtype. Under a float32 model, bfloat16 / float16 pools
    # hold twice the rank rows in the same bytes and halve what a decode step with many adapters reads; adapters
    # saved in that type are kept exactly (widened where read), others are rounded to it.
    lora_dtype: str = "auto"
    # MoE models: device pools of expert rank rows (every expert of every MoE layer; only adapters that target
    # experts take them). 0 = expert LoRA refused. Mixtral-8x7B in bf16: 27 MiB per rank row.
    lora_expert_memory_bytes: int = 0
    max_host_adapters: int = 64  # adapters kept in (pinned) host memory after eviction from the device
    # CUDA: decode steps of up to cuda_graph_max_batch sequences replay CUDA graphs captured at start (one per
    # batch-size bucket); False = every step eager. Ignored on CPU.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 0  # 0 = min(max_num_seqs, max_num_batched_tokens, 256)
    # Bounds on requests
    max_prompt_tokens: int = 0  # 0 = max_model_len - 1
    seed: int = 0
    # CUDA: schedule and launch step N+1 while step N runs on the device (its outputs come one step later; tokens
    # are the same). Ignored on CPU (resolve_async_scheduling).
    async_scheduling: bool = True
    # CPU
    cpu_threads: int = 0  # compute threads; 0 = torch's count, capped at the cores this process may use
    cpu_compile: bool = False  # torch.compile the forward at start (minutes; faster steps)
    # LoRA at scale: host memory of the adapters evicted from the device, in bytes beside max_host_adapters' count
    # (0 = the count alone); adapters fetched on first use from URI prefixes (fsspec: file://, s3://, ...) into a
    # local cache of adapter_cache_bytes, least recently used dropped first ("" = $LOOM_CACHE_DIR/adapters)
    max_host_adapter_bytes: int = 0
    adapter_sources: list[str] = field(default_factory=list)
    adapter_cache_dir: str = ""
    adapter_cache_bytes: int = 8 << 30
    # Adapter-aware admission (loom.engine.core.scheduler): queued requests whose adapter holds device rows go before
    # those that need rows placed, but one that has waited this many steps goes before everything queued after it.
    # 0 = strict arrival order (FCFS).
    max_lora_wait_steps: int = 32
    # Adapters whose weights file has at least this many bytes are read and laid out by the engine's loader process
    # (loom.lora.load_process: off the interpreter, paced to lora_load_cpu_share, so loads do not slow running streams);
    # smaller ones on the loader thread (their work is shorter than the process's start).
    lora_load_process_min_bytes: int = 1 << 20
    # On the CPU, the share of one core adapter loads (the loader process's reading and layout, the copies into the
    # pools' rows) may take while requests run: they share the cores the steps compute on, and slow the running
    # streams' steps by about this fraction (bench_lora --load-during). More when more requests wait for adapters
    # not on the device than run (waiting / (waiting + running) of a core), a whole core when none run
    # (loom.lora.load_pace). 1.0 = loads never paused. Not used on CUDA.
    lora_load_cpu_share: float = 0.03
    # Tensor parallelism: one engine over this many ranks (this process and tensor_parallel_size - 1 worker
    # processes it starts), each holding a shard of every layer and of the KV cache; on CUDA rank r on the r-th
    # visible GPU from the engine's. LoRA adapters are sharded as their layers (each rank its part of A or B;
    # lora_memory_bytes / lora_expert_memory_bytes per rank). Not yet with cpu_compile; CUDA graphs are off.
    tensor_parallel_size: int = 1
    # Speculative decoding (loom.engine.spec_decode): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": .., "prompt_lookup_max": .., "disable_by_batch_size": ..}; a dict or JSON string is
    # converted. None = off. (Optional[...], not "| None": the type is written in docs/CONFIGURATION.md's table,
    # where a pipe would split the cell.)
    speculative_config: Optional[SpeculativeConfig] = None
    # Tensor parallelism across hosts (loom.distributed.rendezvous): nnodes nodes of tensor_parallel_size / nnodes
    # ranks each; this engine is node 0 and listens at master_port for the others (`python -m loom.engine.tp_node
    # --node-rank K`), which reach it at master_addr. Empty / 0 = $MASTER_ADDR / $MASTER_PORT. Ignored on one node
    # (loopback, a free port).
    nnodes: int = 1
    master_addr: str = ""
    master_port: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(name, msg)

        check(self.dtype == "auto" or self.dtype in _DTYPES,
              "dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        check(self.lora_dtype == "auto" or self.lora_dtype in _DTYPES,
              "lora_dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.lora_dtype!r}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              "device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        check(isinstance(self.block_size, int) and self.block_size in (8, 16, 32, 64, 128),
              "block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size!r}")
        check(isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes >= 0,
              "kv_cache_memory_bytes", "must be an integer >= 0 (0 = automatic)")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3), got {self.kv_cache_dtype!r}")
        check(0.05 <= self.gpu_memory_utilization <= 0.99,
              "gpu_memory_utilization", f"must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        check(isinstance(self.max_num_seqs, int) and 1 <= self.max_num_seqs <= 4096,
              "max_num_seqs", f"must be in [1, 4096], got {self.max_num_seqs!r}")
        check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
              "max_num_batched_tokens", "must be an integer >= 1")
        check(isinstance(self.max_model_len, int) and self.max_model_len >= 0,
              "max_model_len", "must be an integer >= 0 (0 = the model's)")
        check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 256,
              "max_lora_rank", f"must be in [1, 256], got {self.max_lora_rank!r}")
        check(isinstance(self.lora_memory_bytes, int) and self.lora_memory_bytes >= 0,
              "lora_memory_bytes", "must be an integer >= 0")
        check(isinstance(self.lora_expert_memory_bytes, int) and self.lora_expert_memory_bytes >= 0,
              "lora_expert_memory_bytes", "must be an integer >= 0 (0 = no LoRA on MoE experts)")
        check(isinstance(self.async_scheduling, bool), "async_scheduling", "must be true or false")
        check(isinstance(self.max_host_adapters, int) and self.max_host_adapters >= 0,
              "max_host_adapters", "must be an integer >= 0")
        check(isinstance(self.cpu_threads, int) and 0 <= self.cpu_threads <= 1024, "cpu_threads",
              f"must be in [0, 1024] (0 = automatic), got {self.cpu_threads!r}")
        check(isinstance(self.cpu_compile, bool), "cpu_compile", f"must be true or false, got {self.cpu_compile!r}")
        check(isinstance(self.cuda_graphs, bool), "cuda_graphs", f"must be true or false, got {self.cuda_graphs!r}")
        check(isinstance(self.cuda_graph_max_batch, int) and 0 <= self.cuda_graph_max_batch <= 4096,
              "cuda_graph_max_batch", f"must be in [0, 4096] (0 = automatic), got {self.cuda_graph_max_batch!r}")
        check(isinstance(self.adapter_roots, list) and all(isinstance(r, str) for r in self.adapter_roots),
              "adapter_roots", "must be a list of directory paths")
        for r in self.adapter_roots:
            check(os.path.isdir(r), "adapter_roots", f"{r!r} is not an existing directory")
        check(isinstance(self.max_host_adapter_bytes, int) and self.max_host_adapter_bytes >= 0,
              "max_host_adapter_bytes", "must be an integer >= 0 (0 = bounded by max_host_adapters only)")
        check(isinstance(self.adapter_sources, list) and all(isinstance(s, str) and "://" in s and "::" not in s
                                                              for s in self.adapter_sources),
              "adapter_sources", "must be a list of URI prefixes such as file:///adapters or s3://bucket/adapters")
        check(isinstance(self.adapter_cache_dir, str), "adapter_cache_dir", "must be a directory path")
        check(isinstance(self.adapter_cache_bytes, int) and self.adapter_cache_bytes >= 1,
              "adapter_cache_bytes", "must be an integer >= 1")
        check(isinstance(self.lora_load_process_min_bytes, int) and self.lora_load_process_min_bytes >= 0,
              "lora_load_process_min_bytes", "must be an integer >= 0 (0 = every adapter through the loader process)")
        check(isinstance(self.lora_load_cpu_share, (int, float)) and not isinstance(self.lora_load_cpu_share, bool)
              and 0.0 < self.lora_load_cpu_share <= 1.0, "lora_load_cpu_share",
              f"must be a fraction of one core in (0, 1], got {self.lora_load_cpu_share!r}")
        check(isinstance(self.max_lora_wait_steps, int) and 0 <= self.max_lora_wait_steps <= 1 << 20,
              "max_lora_wait_steps", f"must be in [0, 1048576] (0 = FCFS), got {self.max_lora_wait_steps!r}")
        tp = self.tensor_parallel_size
        check(isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= 64,
              "tensor_parallel_size", f"must be in [1, 64], got {tp!r}")
        check(tp == 1 or not self.cpu_compile, "tensor_parallel_size",
              f"cpu_compile is not supported with tensor_parallel_size {tp} yet")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # ConfigError naming its field
        n, tp = self.nnodes, self.tensor_parallel_size
        check(isinstance(n, int) and not isinstance(n, bool) and n >= 1 and tp % n == 0,
              "nnodes", f"must be >= 1 and divide tensor_parallel_size {tp} (each node holds as many ranks), got {n!r}")
        check(isinstance(self.master_addr, str), "master_addr", "must be a host name or address")
        check(isinstance(self.master_port, int) and not isinstance(self.master_port, bool)
              and 0 <= self.master_port <= 65535, "master_port",
              f"must be a port in [0, 65535] (0 = $MASTER_PORT), got {self.master_port!r}")
        check(tp == 1 or self.speculative_config is None or self.speculative_config.method != "draft_model",
              "speculative_config.method", f"draft_model is not supported with tensor_parallel_size {tp} yet")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The model's dtype: dtype itself, or for auto: on CUDA the checkpoint's 16-bit type (else bfloat16); on CPU
        bfloat16 where the checkpoint is 16-bit and the CPU has native bfloat16 units (avx512_bf16 or amx_bf16, as
        vLLM's CPU build picks), float32 otherwise (a float32 checkpoint stays float32: no rounding of its weights;
        without those units bfloat16 is emulated and slower than float32). Logged; dtype=float32 overrides."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            import logging

            from loom.kernels.cpu_ext import cpu_flags

            units = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())
            bf16 = checkpoint_dtype in (torch.float16, torch.bfloat16) and bool(units)
            logging.getLogger("loom").info(
                "dtype auto on CPU: %s (checkpoint %s; CPU bfloat16 units: %s; set dtype to override)",
                "bfloat16" if bf16 else "float32", str(checkpoint_dtype).removeprefix("torch."),
                ", ".join(units) or "none")
            return torch.bfloat16 if bf16 else torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache tensor's dtype: the model's (auto), or bytes holding e4m3 codes (kernels/kv_fp8.py)."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_FP8_STORAGE

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        """On CUDA only. A CPU forward returns when its work is done, so no device time is left for the next step's
        host work to hide behind: async would only add the placeholder bookkeeping and deliver every token a step
        later. (Tests emulate the async path on CPU by setting LLMEngine.async_scheduling themselves.)"""
        return self.async_scheduling and device.type == "cuda"

    def resolve_lora_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The adapter pools' dtype: the model's, or a 16-bit type under a float32 model (pools are widened to the
        activations' type where read; a pool type the activations would narrow to is refused)."""
        if self.lora_dtype == "auto" or _DTYPES[self.lora_dtype] == model_dtype:
            return model_dtype
        if model_dtype != torch.float32:
            raise ConfigError("lora_dtype", f"{self.lora_dtype} pools need a float32 model; this one runs in "
                              f"{str(model_dtype).removeprefix('torch.')}: use auto")
        return _DTYPES[self.lora_dtype]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
