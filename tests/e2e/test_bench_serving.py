"""scripts/bench_serving.py at a tiny size against the session's tritonserver (`--url`): every mode of `--mode all`
(concurrency sweep, Poisson arrivals, multi-LoRA) on Triton and on the offline engine in two alternating rounds, with
the right number of tokens, and its tables, JSON and PNG. It targets `loom_compat` with that model's own parameters
(the copy in the test repository) and adapters (alpha, beta, gamma), so the offline engine is configured as the
served model is."""
from __future__ import annotations

import json

from tests.e2e.conftest import COMPAT
from tests.tools.test_bench_scripts import has_matplotlib, one_file, run_script


def test_bench_serving_smoke(tmp_path, server, repo_dir, adapter_root):
    p = run_script("bench_serving.py", "--mode", "all", "--concurrency", "2", "--request-rate", "20",
                   "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--warmup-requests", "1",
                   "--lora-concurrency", "2", "--rounds", "2", "--url", server.grpc_url, "--http-url", server.http_url,
                   "--model", COMPAT, "--model-repository", str(repo_dir), "--adapter-root", str(adapter_root),
                   "--out-dir", str(tmp_path))
    for needle in ("concurrency sweep", "Poisson arrivals", "multi-LoRA", "triton / offline",
                   "one adapter / no adapter", "c=2: per round (2, order alternating)"):
        assert needle in p.stdout, p.stdout
    data = json.loads(one_file(tmp_path, "bench_serving-all-*.json").read_text())
    lora = data["runs"]["lora"]
    assert lora["num_adapters"] == 3  # alpha, beta, gamma
    runs = [data["runs"]["sweep"]["c=2"], data["runs"]["rate"]["20 req/s"]] + list(lora["entries"].values())
    for e in runs:
        for side in ("triton", "offline"):
            s = e[side]
            assert s["ok"] == 6 and s["errors"] == 0 and s["wrong_token_count"] == 0, (side, s)  # 2 rounds
            assert s["ttft_s"]["n"] == 6 and s["output_tok_s"] > 0
        assert len(e["per_round"]["tok_s_ratio"]) == 2 and e["per_round"]["tok_s_ratio_median"] > 0
        assert e["per_round"]["ttft_pairs"] == 6  # every request of both rounds against its in-process twin
    if has_matplotlib():
        assert one_file(tmp_path, "bench_serving-all-*.png").stat().st_size > 0
