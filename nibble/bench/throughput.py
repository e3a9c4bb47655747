"""`nibble bench throughput`: offline throughput of the in-process engine, as `vllm bench throughput` measures it.

Every request of a dataset goes to `LLM.generate` at once (no HTTP server), each with `ignore_eos` and
`max_tokens` = its output length, so that it generates exactly that many tokens; the report is requests/s,
total tokens/s and output tokens/s over the wall time of that one call. The datasets are `nibble bench serve`'s
(`random`, `sharegpt`, `custom`, `prefix_repetition`, built by the same code from a `BenchServeConfig`), always
as token ids, so that the input counts are exact and no tokenization is timed. Flag names follow vLLM's;
`--input-len` / `--output-len` shape the random dataset and `--output-len` fixes the file datasets' output
lengths, as there.

Example:
    nibble bench throughput --model /models/Qwen3.5-35B-A3B-NVFP4 --num-prompts 256 --input-len 512 \\
        --output-len 256 --output-json tput.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nibble.bench.bench_config import BenchError, BenchServeConfig
from nibble.bench.datasets import SampleRequest, load_tokenizer
from nibble.bench.runner import DATASETS, build_requests

DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_CUSTOM_OUTPUT_LEN = 256
# The warm-up's requests: enough to run a prefill, a batched decode step and the bench's sampling path once.
WARMUP_ID_PREFIX = "__bench_throughput_warmup__"
WARMUP_PROMPTS = 2
WARMUP_PROMPT_LEN = 8
WARMUP_OUTPUT_LEN = 3


class ThroughputUsageError(ValueError):
    """Flags or a dataset the benchmark cannot run with (exit code 2)."""


class ThroughputRunError(RuntimeError):
    """The engine did not generate what the run asked for, so its numbers would be wrong (exit code 1)."""


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Register the `bench throughput` flags on `p`: the engine's (shared with `generate` and `bench latency`,
    `--seed` included, which seeds the dataset too, as in vLLM) and vLLM's dataset flags."""
    from nibble.cli import _add_engine_args

    _add_engine_args(p)
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=list(DATASETS), default=None,
                      help="random (default without --dataset-path) | sharegpt (default with it) | custom | "
                           "prefix_repetition")
    data.add_argument("--dataset-path", default=None,
                      help="sharegpt: JSON list of conversations; custom: JSON lines with 'prompt' (and optional "
                           "'output_tokens')")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests submitted at once (default: 1000)")
    data.add_argument("--n", type=int, default=1,
                      help="sequences generated per prompt (parallel sampling, seeded choices; prompt tokens count "
                           "once per prompt, output tokens for every sequence; default: 1)")
    data.add_argument("--input-len", type=int, default=None,
                      help=f"random: prompt tokens per request (default: {DEFAULT_INPUT_LEN})")
    data.add_argument("--output-len", type=int, default=None,
                      help=f"tokens generated per request (random default: {DEFAULT_OUTPUT_LEN}; sharegpt default: "
                           f"the reply's length; custom default: a line's output_tokens, else "
                           f"{DEFAULT_CUSTOM_OUTPUT_LEN})")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="random: lengths drawn uniformly in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    data.add_argument("--random-prefix-len", "--prefix-len", dest="random_prefix_len", type=int, default=0,
                      help="random: tokens shared by every prompt, before (and on top of) its --input-len")
    data.add_argument("--skip-chat-template", "--custom-skip-chat-template", dest="skip_chat_template",
                      action="store_true",
                      help="custom: use the prompts as they are instead of wrapped in the model's chat template")
    prefix = p.add_argument_group("prefix_repetition dataset")
    prefix.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    prefix.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                        help="random tokens after the prefix, per prompt")
    prefix.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                        help="distinct prefixes; --num-prompts are spread evenly over them")
    prefix.add_argument("--prefix-repetition-output-len", type=int, default=None,
                        help=f"tokens to generate per request (default: --output-len, else {DEFAULT_OUTPUT_LEN})")
    out = p.add_argument_group("output")
    out.add_argument("--output-json", default=None, metavar="FILE", help="write the results as JSON")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def dataset_name(args: argparse.Namespace) -> str:
    """vLLM's choice: a dataset file without --dataset-name is ShareGPT, no file the random dataset."""
    return args.dataset_name or ("sharegpt" if args.dataset_path else "random")


def check_args(args: argparse.Namespace) -> None:
    """Refuse values that cannot work, naming the flag, before anything is loaded."""
    name = dataset_name(args)
    positive = {"--num-prompts": args.num_prompts, "--n": args.n, "--input-len": args.input_len,
                "--output-len": args.output_len,
                "--prefix-repetition-output-len": args.prefix_repetition_output_len}
    if name == "prefix_repetition":
        positive["--prefix-repetition-prefix-len"] = args.prefix_repetition_prefix_len
        positive["--prefix-repetition-num-prefixes"] = args.prefix_repetition_num_prefixes
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ThroughputUsageError(f"{flag} must be >= 1, got {value}")
    for flag, value in {"--random-prefix-len": args.random_prefix_len,
                        "--prefix-repetition-suffix-len": args.prefix_repetition_suffix_len}.items():
        if value < 0:
            raise ThroughputUsageError(f"{flag} must be >= 0, got {value}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ThroughputUsageError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if name in ("sharegpt", "custom"):
        if not args.dataset_path:
            raise ThroughputUsageError(f"the {name} dataset reads a file: pass --dataset-path")
        path = Path(args.dataset_path)
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise ThroughputUsageError(f"--dataset-path: dataset file {args.dataset_path} {what}")
    elif args.dataset_path:
        raise ThroughputUsageError(f"--dataset-path: the {name} dataset is generated and reads no file")
    if name == "prefix_repetition" and args.num_prompts < args.prefix_repetition_num_prefixes:
        raise ThroughputUsageError(f"--num-prompts ({args.num_prompts}) must be >= --prefix-repetition-num-prefixes "
                                   f"({args.prefix_repetition_num_prefixes})")
    if args.output_json and not Path(args.output_json).resolve().parent.is_dir():
        # found out before the run, not after it
        raise ThroughputUsageError(f"--output-json: directory {Path(args.output_json).parent} does not exist")
    ignored = {"--input-len": args.input_len is not None and name != "random",
               "--random-range-ratio": bool(args.random_range_ratio) and name != "random",
               "--random-prefix-len": bool(args.random_prefix_len) and name != "random",
               "--output-len": args.output_len is not None and name == "prefix_repetition"
               and args.prefix_repetition_output_len is not None}
    for flag, unused in ignored.items():
        if unused:
            # vLLM warns about these too rather than refusing them
            print(f"warning: {flag} is ignored by the {name} dataset", file=sys.stderr)


def tokenizer_path(args: argparse.Namespace) -> str:
    """The directory (or tokenizer.json) the dataset is tokenized with: the engine's own tokenizer."""
    from nibble.checkpoint.demo import resolve_model_path

    return str(args.tokenizer) if args.tokenizer else str(resolve_model_path(args.model))


def dataset_config(args: argparse.Namespace) -> BenchServeConfig:
    """The `bench serve` dataset settings these flags describe, so that the same code builds the prompts."""
    name = dataset_name(args)
    output_len = args.output_len
    return BenchServeConfig(
        tokenizer=tokenizer_path(args), dataset_name=name, dataset_path=args.dataset_path,
        num_prompts=args.num_prompts, random_input_len=args.input_len or DEFAULT_INPUT_LEN,
        random_output_len=output_len or DEFAULT_OUTPUT_LEN, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, sharegpt_output_len=output_len,
        custom_output_len=output_len or DEFAULT_CUSTOM_OUTPUT_LEN, skip_chat_template=args.skip_chat_template,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.prefix_repetition_output_len or output_len or DEFAULT_OUTPUT_LEN,
        # token ids: the counts are the dataset's, and the engine does not tokenize inside the timed call
        prompt_token_ids=True, seed=args.seed, disable_tqdm=True)


def load_requests(args: argparse.Namespace) -> tuple[BenchServeConfig, list[SampleRequest]]:
    """The dataset's settings and requests; ThroughputUsageError names what is wrong with them."""
    check_args(args)
    cfg = dataset_config(args)
    try:
        cfg.validate()
        tokenizer = load_tokenizer(cfg.tokenizer or "")
        requests = build_requests(cfg, tokenizer=tokenizer)
    except (BenchError, ValueError) as e:
        hint = "" if args.tokenizer or "tokenizer.json" not in str(e) else " (pass --tokenizer DIR)"
        raise ThroughputUsageError(f"{e}{hint}") from e
    return cfg, requests


def check_context(requests: list[SampleRequest], max_model_len: int, cfg: BenchServeConfig, why: str) -> None:
    """Every request's prompt plus output must fit the engine's context, as the engine would refuse it."""
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    need = longest.prompt_len + longest.output_len
    if need <= max_model_len:
        return
    if cfg.dataset_name == "random":
        source = "--input-len, --output-len, --random-prefix-len or --random-range-ratio"
    elif cfg.dataset_name == "prefix_repetition":
        source = "the --prefix-repetition-* lengths"
    else:
        source = f"--output-len or the prompts of {cfg.dataset_path}"
    raise ThroughputUsageError(
        f"a request needs {longest.prompt_len} prompt + {longest.output_len} output = {need} tokens, more than the "
        f"max model len {max_model_len} ({why}); lower {source}, or raise --max-model-len")


def model_context_len(args: argparse.Namespace) -> int:
    """The context the engine will have (--max-model-len, else the model's default), read from config.json
    alone, so that too long a dataset is refused before the weights load."""
    from nibble.checkpoint.demo import resolve_model_path
    from nibble.engine.llm_engine import check_max_model_len
    from nibble.models.config import ModelConfig

    config = ModelConfig.from_pretrained(resolve_model_path(args.model), args.hf_overrides)
    return check_max_model_len(args.max_model_len, config)


def sampling_params(output_len: int, n: int = 1) -> Any:
    """vLLM's throughput settings: plain sampling at temperature 1, exactly `output_len` tokens, n sequences."""
    from nibble.engine.sampling_params import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def warm_up(engine: Any, requests: list[SampleRequest]) -> None:
    """A few short requests through the bench's own sampling path, then `engine.reset()`.

    The engine's start-up warm-up (GPU, unless --no-warmup) already compiles every step shape and its CUDA
    graphs are captured at construction; this covers what is left before the first timed step (the sampling
    of these settings; on CPU, the first calls), and the reset leaves the prefix cache, the counters and the
    sampling generator as at start-up, so that the timed run is the same with or without it."""
    max_len = engine.max_model_len
    for i in range(WARMUP_PROMPTS):
        prompt = list(requests[i % len(requests)].prompt)
        # short, and within any context the requests themselves fit (at least 2 tokens)
        prompt = prompt[: max(1, min(WARMUP_PROMPT_LEN, len(prompt), max_len // 2))]
        output_len = max(1, min(WARMUP_OUTPUT_LEN, max_len - len(prompt)))
        engine.add_request(f"{WARMUP_ID_PREFIX}{i}", prompt, sampling_params(output_len))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset()


@dataclass
class ThroughputResult:
    """One timed run: the wall time of the generate call and the tokens the engine reported for it."""

    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int
    # prompt tokens served from the prefix cache (prefix_repetition shows it working)
    num_cached_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    def to_dict(self) -> dict[str, Any]:
        """vLLM's result fields (plus the prompt, output and cached token counts)."""
        t, total, output = self.elapsed_time, self.total_num_tokens, self.total_output_tokens
        return {"elapsed_time": t, "num_requests": self.num_requests, "total_num_tokens": total,
                "total_prompt_tokens": self.total_prompt_tokens, "total_output_tokens": output,
                "num_cached_tokens": self.num_cached_tokens, "requests_per_second": self.num_requests / t,
                "tokens_per_second": total / t, "output_tokens_per_second": output / t}


def check_outputs(requests: list[SampleRequest], outputs: list[Any], n: int = 1) -> None:
    """ThroughputRunError unless every request read its prompt and generated n sequences of exactly its output
    length."""
    problems = []
    for i, (req, out) in enumerate(zip(requests, outputs)):
        got_in, got_out = len(out.prompt_token_ids), [len(c.token_ids) for c in out.outputs]
        if out.error or got_in != req.prompt_len or got_out != [req.output_len] * n:
            error = f" ({out.error})" if out.error else ""
            shown = got_out[0] if n == 1 and got_out else got_out
            problems.append(f"request {i}: {got_in} prompt / {shown} output tokens, expected {req.prompt_len} / "
                            f"{req.output_len}{f' x {n}' if n > 1 else ''}{error}")
    if len(outputs) != len(requests):
        problems.insert(0, f"{len(outputs)} outputs for {len(requests)} requests")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ThroughputRunError("the engine did not generate the requested token counts, so no throughput is "
                                 f"reported: {'; '.join(problems[:3])}{more}")


def run_throughput(llm: Any, requests: list[SampleRequest], use_tqdm: bool = False, n: int = 1) -> ThroughputResult:
    """Submit every request (n sequences each) to `llm.generate` at once and time that call; the counts come
    from the outputs and are checked against the requests (`check_outputs`)."""
    import torch

    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    params = [sampling_params(r.output_len, n) for r in requests]
    device = llm.engine.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    check_outputs(requests, outputs, n)
    return ThroughputResult(
        elapsed_time=elapsed, num_requests=len(outputs),
        total_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        total_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        num_cached_tokens=sum(o.num_cached_tokens for o in outputs))


def environment(engine: Any) -> dict[str, Any]:
    """Where the numbers come from: device, GPU name and the versions that shape the kernels."""
    import torch

    import nibble

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    device = engine.device
    return {"device": str(device),
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda, "triton_version": triton_version,
            "nibble_version": nibble.__version__, "python_version": platform.python_version()}


def run_cli(args: argparse.Namespace) -> int:
    """Run `bench throughput` from parsed flags: exit code 2 for unusable flags or datasets (before the model
    loads where it can be told), 1 when the engine's token counts are not the requested ones."""
    from nibble.cli import engine_config_from_args
    from nibble.engine.llm import LLM

    try:
        data_cfg, requests = load_requests(args)
        check_context(requests, model_context_len(args), data_cfg, "--max-model-len" if args.max_model_len
                      else "the model's default context; --max-model-len sets it")
        cfg = engine_config_from_args(args)
        llm = LLM(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        check_context(requests, llm.engine.max_model_len, data_cfg, "the engine's, lowered to what the KV cache holds")
    except ThroughputUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"device {llm.engine.device}, {data_cfg.dataset_label()}, {len(requests)} prompts", flush=True)
    warm_up(llm.engine, requests)
    try:
        result = run_throughput(llm, requests, use_tqdm=not args.disable_tqdm, n=args.n)
    except ThroughputRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    r = result.to_dict()
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result.total_prompt_tokens}")
    print(f"Total num output tokens:  {result.total_output_tokens}")
    if result.num_cached_tokens:
        print(f"Prompt tokens from the prefix cache: {result.num_cached_tokens}")
    if args.output_json:
        doc = {**r, "model": args.model, "dataset": data_cfg.dataset_params(),
               "engine_config": dataclasses.asdict(llm.engine.config), **environment(llm.engine),
               "argv": list(sys.argv), "args": {k: v for k, v in vars(args).items() if k != "func"}}
        Path(args.output_json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"results written to {args.output_json}")
    return 0
