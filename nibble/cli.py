"""The `nibble` command: generate | serve | run-batch | quantize | doctor | bench {serve,latency,throughput}.

Each subcommand's flags and work live in its package (`add_cli_args` / `run_cli`); this module only
dispatches, sets up logging and turns expected errors into one clear line and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from nibble.server.compat_args import HF_OVERRIDES_HELP, hf_overrides_arg

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="checkpoint directory, or 'demo' for the embedded demo model")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="modelopt_fp4 | modelopt | nvfp4, checked against the checkpoint (default: the checkpoint's)")
    p.add_argument("--language-model-only", action="store_true",
                   help="do not load the vision tower (text prompts only; its memory goes to the KV cache)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3")
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights from config.json)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-max-batch-size", "--max-cudagraph-capture-size", type=int, default=256,
                   dest="cuda_graph_max_batch_size", metavar="N",
                   help="largest decode batch captured in a CUDA graph (default: 256)")
    p.add_argument("--cuda-graph-max-mixed-tokens", type=int, default=512,
                   help="largest prefill or mixed prefill+decode step, in tokens, run from a CUDA graph (0: such "
                        "steps run eagerly; at most 512; default: 512)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="wait for each step's tokens before scheduling the next (default: overlap them)")
    p.add_argument("--no-shared-expert-overlap", dest="shared_expert_overlap", action="store_false",
                   help="run each MoE block's shared expert after its routed experts on one CUDA stream (default: "
                        "beside them, on a second stream)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the start-up warm-up that compiles kernels for every step shape (GPU only)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks and GDN state of prompt prefixes seen before")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe-backend", default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--linear-backend", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="draft tokens per step from the model's MTP head (speculative decoding; default: 0 = off)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding flag, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    p.add_argument("--hf-overrides", type=hf_overrides_arg, default=None, metavar="JSON", help=HF_OVERRIDES_HELP)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from nibble.engine.config import EngineConfig, parse_speculative_config

    spec = getattr(args, "speculative_config", None)
    if spec and args.num_speculative_tokens:
        from nibble.engine.config import EngineConfigError

        raise EngineConfigError("give --speculative-config or --num-speculative-tokens, not both")
    speculative = (parse_speculative_config(spec) if spec
                   else {"num_speculative_tokens": args.num_speculative_tokens})
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
        cuda_graph_max_mixed_tokens=args.cuda_graph_max_mixed_tokens, quantization=args.quantization,
        limit_mm_per_prompt={"image": 0, "video": 0} if args.language_model_only else None,
        async_scheduling=args.async_scheduling, shared_expert_overlap=args.shared_expert_overlap,
        warmup=args.warmup, seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        moe_backend=args.moe_backend, attention_backend=args.attention_backend, linear_backend=args.linear_backend,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        hf_overrides=args.hf_overrides, **speculative)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed-request", type=int, default=None, dest="request_seed", help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print results as JSON lines")


def _run_generate(args: argparse.Namespace) -> int:
    from nibble.engine.llm import LLM
    from nibble.engine.sampling_params import SamplingParams

    prompts = args.prompt or ([sys.stdin.read()] if not sys.stdin.isatty() else [])
    if not prompts:
        print("error: give at least one --prompt (or pipe text on stdin)", file=sys.stderr)
        return 2
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.request_seed, stop=args.stop,
                        ignore_eos=args.ignore_eos)
    cfg = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in cfg.__dict__.items() if k != "extra"})
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp,
                        enable_thinking=not args.no_thinking)
    else:
        outs = llm.generate(prompts, sp)
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}\n{o.text}\n--- ({len(o.token_ids)} tokens, finish_reason={o.finish_reason})")
    return 0


LAZY_COMMANDS = {("serve",): "nibble.server.launch", ("run-batch",): "nibble.server.run_batch",
                 ("quantize",): "nibble.checkpoint.quantize",
                 ("doctor",): "nibble.doctor", ("bench", "serve"): "nibble.bench.serve",
                 ("bench", "latency"): "nibble.bench.latency",
                 ("bench", "throughput"): "nibble.bench.throughput"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in argv imports its module (keeps --help and startup fast)."""
    argv = argv or []
    commands = {"generate", *(key[0] for key in LAZY_COMMANDS)}
    first = next((i for i, a in enumerate(argv) if a in commands), None)
    words = argv[first:first + 2] if first is not None else []
    parser = argparse.ArgumentParser(prog="nibble", description="Inference server for NVFP4 Qwen3.5-MoE models")
    parser.add_argument("--log-level", default=os.environ.get("NIBBLE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (default model: the embedded demo)")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    g.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    g.set_defaults(func=_run_generate)

    subparsers = {
        ("serve",): sub.add_parser("serve", help="OpenAI-compatible HTTP server"),
        ("run-batch",): sub.add_parser("run-batch", help="answer a file of OpenAI batch requests offline "
                                                         "(vLLM's run-batch)"),
        ("quantize",): sub.add_parser("quantize", help="BF16 Hugging Face checkpoint -> ModelOpt NVFP4 checkpoint"),
        ("doctor",): sub.add_parser("doctor", help="check the stack: GPUs, Triton, kernel self-tests, a checkpoint"),
    }
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    subparsers[("bench", "serve")] = bsub.add_parser("serve", help="load generator for any OpenAI-compatible server")
    subparsers[("bench", "latency")] = bsub.add_parser("latency", help="offline decode step time and tok/s vs roofline")
    subparsers[("bench", "throughput")] = bsub.add_parser("throughput", help="offline requests/s and tokens/s of the "
                                                          "engine, all prompts at once (vllm bench throughput)")
    for key, module in LAZY_COMMANDS.items():
        if tuple(words[: len(key)]) == key:
            import importlib

            mod = importlib.import_module(module)
            mod.add_cli_args(subparsers[key])
            subparsers[key].set_defaults(func=mod.run_cli)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from nibble.kernels.registry import KernelSelectionError

        if isinstance(e, KernelSelectionError):
            print(f"error: kernel selection failed: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
