"""EngineConfig: every knob of one serving engine, frozen, with derived values as properties."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from nibble.engine.media import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S, MediaPolicy

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
          "float": torch.float32}


SPECULATIVE_METHODS = ("mtp", "ngram")
# vLLM's names for the drafters: the MTP head (Qwen3-Next / Qwen3.5) and prompt lookup (engine/ngram_proposer.py)
_METHOD_ALIASES = {"mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "ngram": "ngram"}
MAX_SPECULATIVE_TOKENS = 8
# vLLM's default n-gram sizes when --speculative-config names neither prompt_lookup_min nor prompt_lookup_max
DEFAULT_PROMPT_LOOKUP = 5
# vLLM's --scheduling-policy values: arrival order, or each request's `priority` (lower first) then arrival
SCHEDULING_POLICIES = ("fcfs", "priority")
# the input kinds --limit-mm-per-prompt counts
MM_KINDS = ("image", "video")
# vLLM's --max-logprobs default: the most log-probabilities per token a request may ask for
DEFAULT_MAX_LOGPROBS = 20
_SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def parse_speculative_config(text: str | dict[str, Any]) -> dict[str, Any]:
    """EngineConfig fields from vLLM's `--speculative-config` JSON (or the dict of `LLM(speculative_config=...)`):
    '{"method": "mtp", "num_speculative_tokens": 2}' (also "qwen3_next_mtp" / "qwen3_5_mtp"), or
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'.
    Raises EngineConfigError."""
    spec: Any = text
    if isinstance(text, str):
        try:
            spec = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
            raise EngineConfigError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise EngineConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(spec) - set(_SPEC_FIELDS))
    if unknown:
        raise EngineConfigError(f"--speculative-config: unsupported field(s) {', '.join(unknown)} (nibble takes "
                                f"{', '.join(_SPEC_FIELDS)})")
    method = spec.get("method", "mtp")
    if method not in _METHOD_ALIASES:
        raise EngineConfigError(f"--speculative-config: method must be one of {', '.join(_METHOD_ALIASES)}, "
                                f"got {method!r}")
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise EngineConfigError(f"--speculative-config: {key} must be an integer, got {value!r}")
    out: dict[str, Any] = {"speculative_method": _METHOD_ALIASES[method],
                           "num_speculative_tokens": spec.get("num_speculative_tokens", 1)}
    lookup_min, lookup_max = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if out["speculative_method"] != "ngram":
        if lookup_min is not None or lookup_max is not None:
            raise EngineConfigError("--speculative-config: prompt_lookup_min / prompt_lookup_max are for method "
                                    "ngram")
        return out
    # as vLLM: one bound given stands for both
    default = DEFAULT_PROMPT_LOOKUP
    out["prompt_lookup_min"] = lookup_min if lookup_min is not None else (default if lookup_max is None else lookup_max)
    out["prompt_lookup_max"] = lookup_max if lookup_max is not None else (default if lookup_min is None else lookup_min)
    return out


class EngineConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. `model` is a checkpoint directory (or 'demo')."""

    model: str
    tokenizer: str | None = None
    # a Jinja chat template, or the path of a file holding one, in place of the tokenizer's (--chat-template)
    chat_template: str | None = None
    served_model_name: str | None = None
    # request defaults: "auto" (the model's generation_config.json), "vllm" (none) or a directory holding a
    # generation_config.json; then single fields replaced (generation_config.load_generation_defaults)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_gb: float | None = None
    enforce_eager: bool = False
    async_scheduling: bool = True
    # MoE blocks run their shared expert on a second CUDA stream beside the routed experts (layers/moe.py)
    shared_expert_overlap: bool = True
    warmup: bool = True
    cuda_graph_max_batch_size: int = 256
    cuda_graph_max_mixed_tokens: int = 512
    seed: int = 0
    moe_backend: str | None = None
    attention_backend: str | None = None
    linear_backend: str | None = None
    self_test: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_waiting_requests: int = 4096
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    prefix_cache_slots: int = 16
    speculative_method: str = "mtp"
    num_speculative_tokens: int = 0
    # n-gram drafting (speculative_method "ngram"): the longest suffix of min..max tokens that occurred before
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # image URLs of requests (engine/media.py): fetch limits, and which hosts / local directory may be read
    media_fetch_timeout_s: float = DEFAULT_TIMEOUT_S
    max_media_bytes: int = DEFAULT_MAX_BYTES
    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    # most images / videos one prompt may hold (vLLM's --limit-mm-per-prompt, e.g. {"image": 4, "video": 1});
    # a kind left out is unlimited; both 0: text only, the vision tower is not even loaded
    limit_mm_per_prompt: dict[str, int] | None = None
    # vLLM's --quantization: None takes the checkpoint's; a name is checked against the checkpoint at start-up
    # (models/quant_config.check_quantization), so that a command line meant for another checkpoint fails loudly
    quantization: str | None = None
    # the most logprobs / top_logprobs / prompt_logprobs one request may ask for (vLLM's --max-logprobs);
    # -1: no cap but the vocabulary size
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # vLLM's --hf-overrides: config.json fields deep-merged into the checkpoint's before it is read (every rank
    # alike), e.g. {"text_config": {"rope_parameters": {"rope_type": "yarn", ...}}} for YaRN long context
    hf_overrides: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise EngineConfigError(msg)

        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got '{self.kv_cache_dtype}'")
        check(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        check(self.load_format in ("auto", "dummy"), f"--load-format must be auto or dummy, got '{self.load_format}'")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
              f"--block-size must be a power of 2, got {self.block_size}")
        check(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1,
              f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.max_model_len is None or self.max_model_len >= 1,
              f"--max-model-len must be >= 1, got {self.max_model_len}")
        check(self.cuda_graph_max_batch_size >= 1,
              f"--cuda-graph-max-batch-size must be >= 1, got {self.cuda_graph_max_batch_size}")
        check(self.cuda_graph_max_mixed_tokens >= 0,
              f"--cuda-graph-max-mixed-tokens must be >= 0, got {self.cuda_graph_max_mixed_tokens}")
        check(self.prefix_cache_slots >= 0, f"--prefix-cache-slots must be >= 0, got {self.prefix_cache_slots}")
        check(self.speculative_method in SPECULATIVE_METHODS,
              f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got '{self.speculative_method}'")
        check(0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              f"--num-speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        check(self.max_num_batched_tokens > self.num_speculative_tokens,
              f"--max-num-batched-tokens must exceed --num-speculative-tokens ({self.num_speculative_tokens}): a "
              f"verify step feeds each sequence {self.num_speculative_tokens + 1} tokens")
        check(self.scheduling_policy in SCHEDULING_POLICIES,
              f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got '{self.scheduling_policy}'")
        check(self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              f"--device must be auto, cpu or cuda[:N], got '{self.device}'")
        check(self.media_fetch_timeout_s > 0,
              f"--media-fetch-timeout must be > 0 seconds, got {self.media_fetch_timeout_s}")
        check(self.max_media_bytes > 0, f"--max-media-bytes must be > 0, got {self.max_media_bytes}")
        domains = self.allowed_media_domains
        if domains is not None:
            check(not isinstance(domains, str) and all(isinstance(d, str) and d.strip() for d in domains),
                  f"--allowed-media-domains must be a list of host names, got {domains!r}")
            # a list from Python callers: frozen configs hold tuples
            object.__setattr__(self, "allowed_media_domains", tuple(d.strip() for d in domains))
        check(self.allowed_local_media_path is None or os.path.isdir(self.allowed_local_media_path),
              f"--allowed-local-media-path must be an existing directory, got '{self.allowed_local_media_path}'")
        limits = self.limit_mm_per_prompt
        if limits is not None:
            check(isinstance(limits, dict) and set(limits) <= set(MM_KINDS),
                  f"--limit-mm-per-prompt must be a JSON object with keys among {', '.join(MM_KINDS)}, got {limits!r}")
            check(all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values()),
                  f"--limit-mm-per-prompt values must be integers >= 0, got {limits!r}")
        check(self.quantization is None or isinstance(self.quantization, str),
              f"--quantization must be a method name, got {self.quantization!r}")
        if isinstance(self.quantization, str):
            # vLLM spells the names in lower case; "none" is its unset value
            method = self.quantization.strip().lower()
            object.__setattr__(self, "quantization", None if method in ("", "none") else method)
        check(isinstance(self.max_logprobs, int) and self.max_logprobs >= -1,
              f"--max-logprobs must be >= 0, or -1 for no cap, got {self.max_logprobs}")
        check(self.hf_overrides is None or isinstance(self.hf_overrides, dict),
              f"--hf-overrides must be a JSON object of config.json fields, got {self.hf_overrides!r}")

    @property
    def speculative(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def mtp_drafts(self) -> bool:
        """Whether speculative decoding drafts with the model's MTP head (which then needs its KV cache and
        its passes after each step); n-gram drafts are found on the host from the request's tokens."""
        return self.speculative and self.speculative_method == "mtp"

    def mm_limit(self, kind: str) -> int | None:
        """The most inputs of `kind` ("image" / "video") one prompt may hold; None: no limit."""
        return (self.limit_mm_per_prompt or {}).get(kind)

    @property
    def vision_enabled(self) -> bool:
        """False when --limit-mm-per-prompt allows no image and no video: the vision tower is then not loaded."""
        return not (self.mm_limit("image") == 0 and self.mm_limit("video") == 0)

    @property
    def media_policy(self) -> MediaPolicy:
        """What the engine may fetch for image URLs (engine/media.py)."""
        return MediaPolicy(timeout_s=self.media_fetch_timeout_s, max_bytes=self.max_media_bytes,
                           allowed_domains=self.allowed_media_domains,
                           allowed_local_path=self.allowed_local_media_path)

    @property
    def num_state_slots(self) -> int:
        """GDN state slots to allocate: one per sequence (plus one per draft token under speculative
        decoding, for the states after each draft), the reserved scratch slot, and the prefix cache's."""
        per_seq = 1 + self.num_speculative_tokens
        return self.max_num_seqs * per_seq + 1 + (self.prefix_cache_slots if self.enable_prefix_caching else 0)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = DTYPES[self.dtype]
        if dt is not None:
            return dt
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype.startswith("fp8") else self.torch_dtype

    @property
    def forced_backends(self) -> dict[str, str]:
        out = {}
        for group, value in (("moe", self.moe_backend), ("attention", self.attention_backend),
                             ("linear", self.linear_backend)):
            if value and value != "auto":
                out[group] = value
        return out

    def replace(self, **changes: Any) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)
