"""loom_* and vllm:* metrics on Triton's metrics port, through the Python backend's `pb_utils.MetricFamily`.

Two name sets, chosen by config (`metrics`, `vllm_metrics` / vllm_backend's REPORT_CUSTOM_METRICS):
* loom_*: this project's counters, histograms and gauges;
* vllm:*: what vllm_backend exports (token counters; TTFT, time per output token observed per token, e2e latency,
  prompt / generation length and n histograms, with its buckets) plus the model-server-protocol gauges that the
  Gateway API Inference Extension's endpoint picker reads: vllm:num_requests_waiting / _running,
  vllm:kv_cache_usage_perc (and the older vllm:gpu_cache_usage_perc), vllm:cache_config_info{block_size,
  num_gpu_blocks} and vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters} whose value
  is the time of its last update. That one series is replaced whenever its adapter sets change, so the endpoint
  shows the current sets only: a MetricFamily keeps every Metric it made until the family itself is deleted, so
  the family is deleted (taking the old series with it) and made again with the new labels.
* loom_lora_*, for routers and dashboards of many adapters (in the loom set): requests running / waiting per adapter
  (`lora_name`; series only for adapters with requests, replaced like vllm:lora_requests_info's), the latency of
  adapter loads by `tier` (disk_to_host, remote_to_host, host_to_device: loom.lora.lora_stats), adapters and bytes
  per memory tier (loom_lora_device_bytes: the device rows adapters hold), evictions per tier (device, host, cache),
  compactions of the device rows, fetches from the adapter sources, and the CPU share adapter loads may take now
  (loom_lora_load_cpu_share: loom.lora.load_pace; below 1 while the loads are paced).

`pb_utils` is passed in (only backend/model.py imports triton_python_backend_utils) and the families
must be created inside `initialize()`. Each metric call is an IPC round trip to the server, so the
engine loop never makes one: it hands stats to `on_step` / `on_request_finished` (cheap, under a lock)
and one thread applies them, coalescing gauge updates to at most one set per `interval_s` and setting a gauge
only when its value changed. The round trips are not free for the engine either: the stub holds the GIL through
each one (its bindings do not release it), and on a CPU engine, one request at a time, setting every gauge on
every update put the time to first token ~13 ms above the same engine in-process, ~7 ms with changed values only.
Rules that keep Triton 2.51 alive: counters only get positive increments, gauges only `set`, and
`value()` is never called on a histogram.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Sequence

from loom.engine.outputs import EngineStats, SpecDecodingStats
from loom.lora.lora_stats import LOAD_TIERS, LoraStats
from loom.serving.async_engine import RequestTiming

log = logging.getLogger("loom.metrics")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "cancelled", "timeout", "error", "rejected")
# vllm_backend's buckets (src/utils/metrics.py)
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]
# vllm:lora_requests_info's value (the time of its last update) is refreshed at most this often while its labels stay
LORA_INFO_REFRESH_S = 1.0
# adapter loads: a host -> device copy takes ~1 ms, a fetch from remote storage seconds
LORA_LOAD_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
LORA_EVICTION_TIERS = ("device", "host", "cache")


def buckets_1_2_5(limit: int) -> list[float]:
    out, m = [], 1
    while True:
        for k in (1, 2, 5):
            v = k * m
            if v > limit:
                return out
            out.append(float(v))
        m *= 10


class LoomMetrics:
    """Implements async_engine.Observer. `names`: which sets to export ("loom", "vllm")."""

    def __init__(self, pb_utils, labels: dict[str, str], max_model_len: int = 8192, interval_s: float = 0.05,
                 names: Sequence[str] = ("loom",), lora_info_prefix: str = "",
                 cache_info: dict[str, int] | None = None):
        MF = self._MF = pb_utils.MetricFamily
        self.labels = dict(labels)
        self.loom = "loom" in names
        self.vllm = "vllm" in names
        # Families must outlive their metrics: a collected family makes every later call fail.
        self._families: list = []

        def family(name: str, desc: str, kind):
            self._families.append(MF(name=name, description=desc, kind=kind))
            return self._families[-1]

        def counter(name, desc):
            return family(name, desc, MF.COUNTER).Metric(labels=labels)

        def gauge(name, desc):
            return family(name, desc, MF.GAUGE).Metric(labels=labels)

        def hist(name, desc, buckets):
            return family(name, desc, MF.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        if self.loom:
            self.prompt_tokens = counter("loom_prompt_tokens_total", "Number of prompt tokens processed (prefill).")
            self.generation_tokens = counter("loom_generation_tokens_total", "Number of tokens generated.")
            finished = family("loom_request_finished_total", "Requests finished, by reason.", MF.COUNTER)
            self.finished = {r: finished.Metric(labels={**labels, "reason": r}) for r in FINISH_REASONS}
            self.ttft = hist("loom_time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
            self.tpot = hist("loom_time_per_output_token_seconds",
                             "Mean time per output token after the first, one observation per request.", TPOT_BUCKETS)
            self.e2e = hist("loom_e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
            lengths = buckets_1_2_5(max(max_model_len, 1))
            self.prompt_len = hist("loom_request_prompt_tokens", "Prompt length of finished requests.", lengths)
            self.gen_len = hist("loom_request_generation_tokens", "Generated tokens of finished requests.", lengths)
            self.running = gauge("loom_num_requests_running", "Requests in the running batch.")
            self.waiting = gauge("loom_num_requests_waiting", "Requests waiting to be scheduled.")
            self.kv_used = gauge("loom_kv_blocks_used", "KV cache blocks in use.")
            self.kv_total = gauge("loom_kv_blocks_total", "KV cache blocks in the pool.")
            self.kv_usage = gauge("loom_kv_cache_usage_perc", "KV cache usage, 1 = full.")
            self.prefix_hit = gauge("loom_prefix_cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / prompt tokens.")
            self.adapters = gauge("loom_resident_adapters", "LoRA adapters resident in device memory.")
            self.preemptions = gauge("loom_num_preemptions", "Preemptions since start.")
            self.lora_running = _SeriesSet(MF, "loom_lora_requests_running", "Requests running, per LoRA adapter.")
            self.lora_waiting = _SeriesSet(MF, "loom_lora_requests_waiting", "Requests waiting, per LoRA adapter.")
            loads = family("loom_lora_load_seconds", "Adapter load latency, by the tiers it moves between.",
                           MF.HISTOGRAM)
            self.lora_loads = {t: loads.Metric(labels={**labels, "tier": t}, buckets=LORA_LOAD_BUCKETS)
                               for t in LOAD_TIERS}
            tiers = family("loom_lora_adapters", "LoRA adapters per memory tier (host: evicted from the device).",
                           MF.GAUGE)
            self.lora_tiers = {t: tiers.Metric(labels={**labels, "tier": t}) for t in ("device", "host")}
            self.lora_host_bytes = gauge("loom_lora_host_bytes", "Bytes of the LoRA adapters in the host tier.")
            self.lora_cache_bytes = gauge("loom_lora_cache_bytes", "Bytes of the fetched adapters' local cache.")
            evictions = family("loom_lora_evictions_total", "LoRA adapters evicted, by tier (device: rows taken "
                               "for another; host: dropped to disk; cache: dropped from the local cache).", MF.COUNTER)
            self.lora_evictions = {t: evictions.Metric(labels={**labels, "tier": t}) for t in LORA_EVICTION_TIERS}
            self.lora_fetches = counter("loom_lora_fetches_total", "Adapters transferred from the adapter sources.")
            self.lora_device_bytes = gauge("loom_lora_device_bytes", "Bytes of the device LoRA rows adapters hold.")
            self.lora_compactions = counter("loom_lora_compactions_total", "Compactions of the device LoRA rows.")
            self.lora_load_share = gauge("loom_lora_load_cpu_share", "The share of one CPU core adapter loads may "
                                         "take now (lora_load_cpu_share, more when requests wait; 1: unpaced).")
            self._lora_seen = LoraStats()  # the counters and the last load already exported
            self._lora_load_seq = 0
        if self.vllm:
            self.v_prompt = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
            self.v_gen = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
            self.v_ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               VLLM_TTFT_BUCKETS)
            self.v_tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                               VLLM_TPOT_BUCKETS)
            self.v_e2e = hist("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.", VLLM_E2E_BUCKETS)
            lengths = buckets_1_2_5(max(max_model_len, 1))
            self.v_prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
            self.v_gen_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", lengths)
            self.v_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", VLLM_N_BUCKETS)
            self.v_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
            self.v_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
            self.v_kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
            self.v_gpu_kv = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                                  "(the older name of vllm:kv_cache_usage_perc).")
            info = {k: str(v) for k, v in (cache_info or {}).items()}
            self.v_cache_info = family("vllm:cache_config_info", "Information of the KV cache configuration.",
                                       MF.GAUGE).Metric(labels={**labels, **info})
            self.v_cache_info.set(1.0)
            self._lora_info = _SeriesSet(MF, "vllm:lora_requests_info", "Running stats on lora requests.")
            self._lora_prefix = lora_info_prefix
            self._lora_set_at = 0.0
            # speculative decoding, vLLM's counters (exposed with prometheus_client's _total suffix, as vLLM shows them)
            self.v_spec_drafts = counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.")
            self.v_spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.")
            self.v_spec_accepted = counter("vllm:spec_decode_num_accepted_tokens_total",
                                           "Number of accepted tokens.")
            self._spec_pos = family("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                    "Accepted tokens per draft position.", MF.COUNTER)
            self.v_spec_per_pos: list = []  # one series per draft position, made as positions appear
            self._spec_seen = SpecDecodingStats()

        self.interval_s = interval_s
        self._last: dict[int, float] = {}  # id(gauge) -> the value last set
        self._cond = threading.Condition()
        self._stats: EngineStats | None = None
        self._prompt = self._gen = 0
        self._itl: list[float] = []
        self._done: list[RequestTiming] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loom-metrics", daemon=True)
        self._thread.start()

    # Observer (loop thread): only record, never call into Triton here.
    def on_step(self, stats: EngineStats, prompt_tokens: int, generation_tokens: int,
                inter_token_latencies: Sequence[float] = ()) -> None:
        with self._cond:
            self._stats = stats
            self._prompt += prompt_tokens
            self._gen += generation_tokens
            if self.vllm and inter_token_latencies:
                self._itl.extend(inter_token_latencies)
            self._cond.notify()

    def on_request_finished(self, timing: RequestTiming) -> None:
        with self._cond:
            self._done.append(timing)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stats is not None or self._done or self._prompt or self._gen or self._stopping):
                    self._cond.wait()
                stats, self._stats = self._stats, None
                prompt, gen, self._prompt, self._gen = self._prompt, self._gen, 0, 0
                done, self._done = self._done, []
                itl, self._itl = self._itl, []
                stopping = self._stopping
            try:
                if self.loom:
                    self._apply(stats, prompt, gen, done)
                if self.vllm:
                    self._apply_vllm(stats, prompt, gen, done, itl)
            except Exception:
                log.error("metrics update failed:\n%s", traceback.format_exc())
            if stopping:
                return
            time.sleep(self.interval_s)  # coalesce: one update per interval however fast the engine steps

    def _set(self, gauge, value: float) -> None:
        if self._last.get(id(gauge)) != value:
            gauge.set(value)
            self._last[id(gauge)] = value

    def _apply(self, stats: EngineStats | None, prompt: int, gen: int, done: list[RequestTiming]) -> None:
        if prompt > 0:
            self.prompt_tokens.increment(prompt)
        if gen > 0:
            self.generation_tokens.increment(gen)
        for t in done:
            if t.error_kind == "invalid":  # refused by the engine (unknown adapter, prompt too long): no latency
                self.finished["rejected"].increment(1)
                continue
            reason = t.error_kind if t.error_kind in ("cancelled", "timeout") else (
                "error" if t.error_kind else (t.finish_reason if t.finish_reason in FINISH_REASONS else "abort"))
            self.finished[reason].increment(1)
            self.e2e.observe(max(0.0, t.finished - t.arrival))
            self.prompt_len.observe(float(t.num_prompt_tokens))
            self.gen_len.observe(float(t.num_output_tokens))
            if t.first_token is not None:
                self.ttft.observe(max(0.0, t.first_token - t.arrival))
                if t.num_output_tokens > 1:
                    self.tpot.observe(max(0.0, (t.finished - t.first_token) / (t.num_output_tokens - 1)))
        if stats is not None:
            self._set(self.running, float(stats.num_running))
            self._set(self.waiting, float(stats.num_waiting))
            self._set(self.kv_used, float(stats.kv_blocks_used))
            self._set(self.kv_total, float(stats.kv_blocks_total))
            self._set(self.kv_usage, stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
            self._set(self.prefix_hit, float(stats.prefix_hit_rate))
            self._set(self.adapters, float(stats.resident_adapters))
            self._set(self.preemptions, float(stats.num_preemptions))
            self._apply_lora(stats)

    def _apply_lora(self, stats: EngineStats) -> None:
        for series, counts in ((self.lora_running, stats.running_adapters),
                               (self.lora_waiting, stats.waiting_adapters)):
            self._replace(series, {n: {**self.labels, "lora_name": n} for n in counts})
            for n, c in counts.items():
                self._set(series.series[n], float(c))
        lora, seen = stats.lora, self._lora_seen
        for x in lora.loads:
            if x.seq > self._lora_load_seq:
                self.lora_loads[x.tier].observe(max(0.0, x.seconds))
                self._lora_load_seq = x.seq
        self._set(self.lora_tiers["device"], float(lora.device_adapters))
        self._set(self.lora_tiers["host"], float(lora.host_adapters))
        self._set(self.lora_host_bytes, float(lora.host_bytes))
        self._set(self.lora_cache_bytes, float(lora.cache_bytes))
        self._set(self.lora_device_bytes, float(lora.device_bytes))
        self._set(self.lora_load_share, float(lora.load_cpu_share))
        for metric, now, before in ((self.lora_evictions["device"], lora.device_evictions, seen.device_evictions),
                                    (self.lora_evictions["host"], lora.host_evictions, seen.host_evictions),
                                    (self.lora_evictions["cache"], lora.cache_evictions, seen.cache_evictions),
                                    (self.lora_fetches, lora.remote_fetches, seen.remote_fetches),
                                    (self.lora_compactions, lora.compactions, seen.compactions)):
            if now > before:  # counters only ever get positive increments
                metric.increment(now - before)
        self._lora_seen = lora

    def _apply_vllm(self, stats: EngineStats | None, prompt: int, gen: int, done: list[RequestTiming],
                    itl: list[float]) -> None:
        if prompt > 0:
            self.v_prompt.increment(prompt)
        if gen > 0:
            self.v_gen.increment(gen)
        for x in itl:
            self.v_tpot.observe(max(0.0, x))
        for t in done:
            if t.error_kind == "invalid":  # refused before it ran
                continue
            self.v_e2e.observe(max(0.0, t.finished - t.arrival))
            self.v_prompt_len.observe(float(t.num_prompt_tokens))
            self.v_gen_len.observe(float(t.num_output_tokens))
            self.v_n.observe(float(t.n))
            if t.first_token is not None:
                self.v_ttft.observe(max(0.0, t.first_token - t.arrival))
        if stats is not None:
            self._set(self.v_running, float(stats.num_running))
            self._set(self.v_waiting, float(stats.num_waiting))
            usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
            self._set(self.v_kv, usage)
            self._set(self.v_gpu_kv, usage)
            if stats.max_loras > 0:
                self._set_lora_info(stats)
            self._apply_spec(stats.spec_decoding)

    def _apply_spec(self, spec: SpecDecodingStats) -> None:
        seen = self._spec_seen
        for metric, now, before in ((self.v_spec_drafts, spec.num_drafts, seen.num_drafts),
                                    (self.v_spec_draft_tokens, spec.num_draft_tokens, seen.num_draft_tokens),
                                    (self.v_spec_accepted, spec.num_accepted_tokens, seen.num_accepted_tokens)):
            if now > before:
                metric.increment(now - before)
        while len(self.v_spec_per_pos) < len(spec.accepted_per_pos):
            self.v_spec_per_pos.append(self._spec_pos.Metric(
                labels={**self.labels, "position": str(len(self.v_spec_per_pos))}))
        for j, now in enumerate(spec.accepted_per_pos):
            before = seen.accepted_per_pos[j] if j < len(seen.accepted_per_pos) else 0
            if now > before:
                self.v_spec_per_pos[j].increment(now - before)
        self._spec_seen = spec

    def _set_lora_info(self, stats: EngineStats) -> None:
        """One series whose labels are the current adapter sets; value: when it was last updated."""
        def names(counts: dict[str, int]) -> str:
            return ",".join(self._lora_prefix + n for n in sorted(counts))

        labels = {**self.labels, "max_lora": str(stats.max_loras),
                  "running_lora_adapters": names(stats.running_adapters),
                  "waiting_lora_adapters": names(stats.waiting_adapters)}
        if self._replace(self._lora_info, {"": labels}):
            self._lora_set_at = 0.0
        now = time.time()
        if now - self._lora_set_at >= LORA_INFO_REFRESH_S:  # the time of the last update, to the second
            self._lora_info.series[""].set(now)
            self._lora_set_at = now

    def _replace(self, series: "_SeriesSet", label_sets: dict[str, dict[str, str]]) -> bool:
        """series.replace, forgetting the values last set on the series it drops (a new Metric may get an old one's
        id)."""
        if series.labels == label_sets:
            return False
        for metric in series.series.values():
            self._last.pop(id(metric), None)
        series.replace(label_sets)
        return True

    def close(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        # Metric objects must go before their families (the server refuses the other order).
        for name in [k for k, v in vars(self).items() if k not in ("_families", "_thread", "_cond", "labels")
                     and (hasattr(v, "increment") or isinstance(v, dict) and any(hasattr(x, "increment")
                                                                                 for x in v.values()))]:
            delattr(self, name)
        for v in list(vars(self).values()):
            if isinstance(v, _SeriesSet):
                v.replace({})
        self._families.clear()


class _SeriesSet:
    """A gauge family whose series are replaced as a whole when their label sets change: a MetricFamily keeps every
    Metric it made until the family itself is deleted, so the family is deleted (its series with it) and made again
    with the new ones (none while there are none)."""

    def __init__(self, MF, name: str, description: str):
        self._MF, self.name, self.description = MF, name, description
        self._family = None
        self.labels: dict[str, dict[str, str]] = {}  # key -> the labels of its series
        self.series: dict = {}  # key -> Metric

    def replace(self, label_sets: dict[str, dict[str, str]]) -> None:
        self.series = {}  # Metric objects go before their family
        self._family = None
        if label_sets:
            self._family = self._MF(name=self.name, description=self.description, kind=self._MF.GAUGE)
            self.series = {k: self._family.Metric(labels=lab) for k, lab in label_sets.items()}
        self.labels = dict(label_sets)
