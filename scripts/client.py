#!/usr/bin/env python3
"""Stream one answer from a loom model over Triton gRPC, printing tokens as they arrive.

    python scripts/client.py "The capital of France is" --max-tokens 32
    python scripts/client.py "Tell me about the sea" --adapter pirate --temperature 0.7 --seed 1
    python scripts/client.py --chat "What is the capital of France?"      # ChatML via the model's template
    python scripts/client.py --adapter-op list                             # load | unload | reload | list

Only tritonclient is needed (no torch); --chat needs transformers and the model's tokenizer folder.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient


def _input(name: str, value, dtype: str):
    arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(arr)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt", nargs="?", default="")
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    ap.add_argument("--model", default="loom_smollm2")
    ap.add_argument("--adapter", default=None, help="LoRA adapter name (loads on first use from an adapter root)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="any other sampling parameter")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --chat (default: the default model)")
    ap.add_argument("--no-stream", action="store_true", help="one response at the end")
    ap.add_argument("--stats", action="store_true", help="print finish reason, token counts and timing to stderr")
    ap.add_argument("--adapter-op", choices=("load", "unload", "reload", "list"), default=None)
    ap.add_argument("--adapter-path", default=None, help="folder for --adapter-op load/reload (under an adapter root)")
    args = ap.parse_args(argv)

    client = grpcclient.InferenceServerClient(args.url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result=None, error=None: q.put((result, error)))
    try:
        if args.adapter_op:
            params = {"adapter_op": args.adapter_op}
            if args.adapter:
                params["lora_name"] = args.adapter
            if args.adapter_path:
                params["lora_path"] = args.adapter_path
            client.async_stream_infer(args.model, [_input("text_input", b"", "BYTES")], parameters=params)
            result, error = q.get(timeout=600)
            if error is not None:
                print(f"error: {error.message()}", file=sys.stderr)
                return 1
            print(json.dumps(json.loads(result.as_numpy("text_output")[0]), indent=2))
            return 0

        prompt = args.prompt
        if args.chat:
            from transformers import AutoTokenizer
            tok_dir = args.tokenizer
            if tok_dir is None:
                from harness.default_model import ensure_default_model
                tok_dir = str(ensure_default_model())
            tok = AutoTokenizer.from_pretrained(tok_dir)
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        sp: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        for key, val in (("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed), ("stop", args.stop),
                         ("lora_name", args.adapter)):
            if val is not None:
                sp[key] = val
        for kv in args.param:
            k, _, v = kv.partition("=")
            sp[k] = v  # the server converts by the field's type ("true", "32", "0.5")
        inputs = [_input("text_input", prompt.encode(), "BYTES"), _input("stream", not args.no_stream, "BOOL"),
                  _input("sampling_parameters", json.dumps(sp).encode(), "BYTES"),
                  _input("exclude_input_in_output", True, "BOOL"), _input("return_finish_reason", True, "BOOL"),
                  _input("return_num_output_tokens", True, "BOOL"), _input("return_num_input_tokens", True, "BOOL")]
        t0 = time.monotonic()
        first = None
        n_out = 0
        client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=600)
            if error is not None:
                print(f"\nerror: {error.message()}", file=sys.stderr)
                return 1
            resp = result.get_response()
            if resp.outputs:
                first = first or time.monotonic()
                sys.stdout.write(result.as_numpy("text_output")[0].decode("utf-8", "replace"))
                sys.stdout.flush()
                n_out += int(result.as_numpy("num_output_tokens")[0])
                reason = result.as_numpy("finish_reason")[0].decode()
                n_in = int(result.as_numpy("num_input_tokens")[0])
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        print()
        if args.stats:
            dt = time.monotonic() - t0
            print(f"[finish_reason={reason} prompt_tokens={n_in} output_tokens={n_out} "
                  f"ttft={(first or t0) - t0:.3f}s total={dt:.3f}s]", file=sys.stderr)
        return 0
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
