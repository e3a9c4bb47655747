"""LLMEngine: the synchronous core. `add_request` validates and queues, `step` schedules one batch, runs
the model, samples, detokenizes incrementally, applies stop conditions and reports per-request outputs.

The step loop (overlapped scheduling, speculative-decoding steps, deferred sampling, and what each sampled
token does to its request) is engine_steps.py's, a mixin of LLMEngine; this module builds the engine and takes
requests in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from nibble.checkpoint.demo import resolve_model_path
from nibble.checkpoint.loader import load_model
from nibble.engine.block_manager import BlockManager
from nibble.engine.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.detokenizer import IncrementalDetokenizer, StopChecker
from nibble.engine.engine_steps import EngineSteps
from nibble.engine.errors import EngineOverloaded, RequestError
from nibble.engine.generation_config import GenerationConfigError, load_generation_defaults
from nibble.engine.image_requests import ImageArg, ImageRequests, VideoArg, vision_max_patches
from nibble.engine.kernels import select_engine_kernels
from nibble.engine.model_runner import ModelRunner, num_mtp_layers
from nibble.engine.ngram_proposer import NgramProposer
from nibble.engine.outputs import TextState
from nibble.engine.parallel import WorkerGroup
from nibble.engine.request import Request, RequestOutput, RequestStatus
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from nibble.engine.scheduler import Scheduler
from nibble.engine.structured_output import GrammarBackend, StructuredOutputError
from nibble.engine.thinking_budget import thinking_budget_of
from nibble.engine.token_masks import check_token_fields
from nibble.engine.tokenizer import Tokenizer
from nibble.engine.vision_prompts import VisionPrompts
from nibble.engine.warmup import warm_up
from nibble.models.config import ModelConfig
from nibble.models.quant_config import QuantConfigError, check_quantization

logger = logging.getLogger("nibble.engine")

DEFAULT_MAX_MODEL_LEN = 32768


def check_max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    """The engine's context length: `requested` (--max-model-len), or the model's (at most
    DEFAULT_MAX_MODEL_LEN) when None. RequestError when it exceeds what the model's positions cover
    (max_position_embeddings, or with RoPE scaling what it extends them to, as vLLM derives it)."""
    limit = model_config.max_context_len
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if requested > limit:
        scaling = model_config.rope_scaling
        if scaling is None:
            reason = (f"max_position_embeddings {limit}; to go further enable YaRN RoPE scaling (rope_type 'yarn' in "
                      "rope_parameters, e.g. with --hf-overrides)")
        else:
            reason = (f"context length {limit} ({scaling.rope_type} RoPE scaling: "
                      f"{scaling.original_max_position_embeddings} x factor {scaling.factor:g})")
        raise RequestError(f"--max-model-len {requested} exceeds the model's {reason}")
    return requested


class LLMEngine(EngineSteps, VisionPrompts):
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.model_dir = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir, config.hf_overrides)
        try:
            check_quantization(config.quantization, self.model_config.quant, self.model_dir)
        except QuantConfigError as exc:
            raise EngineConfigError(str(exc)) from None
        self.device = config.torch_device
        tok_dir = Path(config.tokenizer) if config.tokenizer else self.model_dir
        template = None
        if config.chat_template is not None:
            try:
                template = load_chat_template(config.chat_template)
                ChatTemplate(template)
            except ChatTemplateError as exc:
                raise EngineConfigError(str(exc) if str(exc).startswith("--chat-template")
                                        else f"--chat-template: {exc}") from exc
        self.tokenizer: Tokenizer | None = (Tokenizer.from_pretrained(tok_dir, chat_template=template)
                                            if (tok_dir / "tokenizer.json").is_file() else None)
        if template is not None and self.tokenizer is None:
            raise EngineConfigError(f"--chat-template: {tok_dir} has no tokenizer.json to render chats with")
        try:
            self.generation_defaults = load_generation_defaults(self.model_dir, config.generation_config,
                                                                config.override_generation_config)
            # a value no request could use (top_p 0, max_new_tokens -1) fails here, not in every later request
            SamplingParams(**self.generation_defaults.sampling_params_kwargs())
        except GenerationConfigError as exc:
            raise EngineConfigError(str(exc)) from None
        except SamplingParamsError as exc:
            raise EngineConfigError(f"the request defaults of the generation config (--generation-config "
                                    f"{config.generation_config}, --override-generation-config) are invalid: {exc}") \
                from None
        max_model_len = check_max_model_len(config.max_model_len, self.model_config)
        if config.mtp_drafts and self.model_config.mtp_num_hidden_layers < 1:
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: mtp_num_hidden_layers is 0, the model has "
                                    "no MTP head to draft with; drop --num-speculative-tokens, or draft with "
                                    '--speculative-config \'{"method": "ngram", ...}\'')
        self.num_spec_tokens = config.num_speculative_tokens
        self.ngram = (NgramProposer(self.num_spec_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.speculative and not config.mtp_drafts else None)
        self.kernels, self.kernel_report = select_engine_kernels(config, self.model_config)
        # Tensor parallelism: ranks 1..N-1 are worker processes that mirror the model loading and runner
        # construction below and then run every step this engine broadcasts (nibble/engine/worker.py).
        self.workers = (WorkerGroup.start(config, self.model_dir, max_model_len)
                        if config.tensor_parallel_size > 1 else None)
        parallel = self.workers.context if self.workers is not None else None
        try:
            self.model = load_model(self.model_dir, self.model_config, self.kernels, dtype=config.torch_dtype,
                                    device=self.device, load_format=config.load_format,
                                    max_positions=max_model_len + 2 * self.num_spec_tokens, seed=config.seed,
                                    parallel=parallel, num_mtp_layers=num_mtp_layers(config, self.model_config),
                                    load_vision=config.vision_enabled)
            self.runner = ModelRunner(config, self.model_config, self.model, max_model_len, parallel=parallel,
                                      broadcast=self.workers.broadcast if self.workers is not None else None,
                                      send_tokens=self.workers.send_tokens if self.workers is not None else None,
                                      vision_max_patches=vision_max_patches(self.model, self.model_dir))
        except BaseException:
            self.shutdown()
            raise
        # image and video input: only with a vision tower (under tensor parallelism on rank 0, this process)
        visual = getattr(self.model, "visual", None)
        self.images = (ImageRequests(self.model_dir, visual.config.patch_dim, config.media_policy,
                                     config.hf_overrides)
                       if visual is not None else None)
        self.runner.mrope = self.mrope
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, self.runner.num_state_slots,
                                   prefix_caching=config.enable_prefix_caching, num_spec_slots=self.num_spec_tokens)
        # a verify step holds blocks for 2k positions past the computed tokens, k + 1 with n-gram drafts
        # (scheduler._schedule)
        headroom = (2 * self.num_spec_tokens if config.mtp_drafts else self.num_spec_tokens + 1) if config.speculative \
            else 0
        capacity = self.blocks.num_usable_blocks * config.block_size - headroom
        if capacity < max_model_len:
            logger.warning("KV cache holds %d tokens; max_model_len lowered from %d to %d",
                           capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_spec_tokens=self.num_spec_tokens, policy=config.scheduling_policy,
                                   mtp_drafts=config.mtp_drafts)
        self.requests: dict[str, Request] = {}
        self._text: dict[str, TextState] = {}
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(config.seed)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids)
                                          | set(self.generation_defaults.eos_token_ids or ())
                                          | set(self.tokenizer.eos_token_ids if self.tokenizer else ())))
        self._inflight = None
        self._step_error: Exception | None = None
        self._grammars = (GrammarBackend(self.tokenizer.backend, self.model_config.vocab_size, self.eos_token_ids)
                          if self.tokenizer is not None else None)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0
        # verify steps' sequences with drafts, and how often the draft at each position was accepted
        self.num_drafts = 0
        self.num_accepted_per_pos = [0] * self.num_spec_tokens
        if config.warmup and self.device.type == "cuda":
            try:
                self.warm_up()
            except BaseException:
                self.shutdown()
                raise
        logger.info("engine ready in %.1f s: %d KV blocks x %d tokens, %d state slots (%s), max_model_len %d, "
                    "device %s", time.perf_counter() - t0, self.blocks.num_blocks, config.block_size,
                    self.blocks.num_state_slots,
                    f"{config.prefix_cache_slots} for prefix caching" if config.enable_prefix_caching
                    else "prefix caching off", self.max_model_len, self.device)

    def warm_up(self) -> float:
        """Run dummy requests through every kind of step so that kernels are compiled and autotuned before
        real requests arrive (nibble/engine/warmup.py), then `reset()`; returns the seconds taken. Also
        builds the structured-output tokenizer view, so that the first constrained request does not wait."""
        t0 = time.perf_counter()
        if self._grammars is not None:
            self._grammars.prepare()
        warm_up(self)
        return time.perf_counter() - t0

    def structured_output_backend(self) -> GrammarBackend:
        """The grammar backend of this engine's tokenizer (its tokenizer view built on first use)."""
        if self._grammars is None:
            raise RequestError("structured outputs need a tokenizer, and this model has none")
        return self._grammars

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix and the record of prompts seen (vLLM's reset_prefix_cache), so that the
        next prompts are computed cold, e.g. between benchmark runs. Only on an idle engine: returns False, and
        drops nothing, while requests are running or waiting (their entries' copies may still be queued)."""
        if self.has_unfinished_requests():
            return False
        if self._inflight is not None:
            self._finish_step(self._inflight)
            self._inflight = None
        self.blocks.clear_prefix_cache()
        return True

    def reset(self) -> None:
        """Return an idle engine to its start-up state: no step in flight, counters at zero, the sampling
        generator reseeded with the configured seed."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset needs an idle engine: requests are still running or waiting")
        if self._inflight is not None:
            self._finish_step(self._inflight)
            self._inflight = None
        self.blocks.clear_prefix_cache()
        if not self.blocks.all_free():
            raise RuntimeError("reset: KV-cache blocks or state slots are still held by finished requests")
        self.requests.clear()
        self._text.clear()
        self._generator.manual_seed(self.config.seed)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0
        self.num_drafts = 0
        self.num_accepted_per_pos = [0] * self.num_spec_tokens
        self.scheduler.num_prefix_query_tokens = 0
        self.scheduler.num_prefix_hit_tokens = 0
        self.runner.step_counts = dict.fromkeys(self.runner.step_counts, 0)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one device); no step may follow."""
        if self.workers is not None:
            self.workers.shutdown()

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    images: ImageArg | None = None, videos: VideoArg | None = None,
                    queue_cap: bool = True) -> Request:
        """Validate and queue a request. Raises RequestError (or SamplingParamsError) on bad input.

        images: the prompt's images, preprocessed (`vision_processor.preprocess_images`' (pixel_values,
        grid_thw), or a list of `ProcessedImage`), in prompt order; the prompt must then hold one
        image_token_id placeholder per image token (`expand_image_prompt`). videos: likewise its videos
        (`VideoInputs`, a list of `ProcessedVideo`, or (pixel_values, grid_thw)), the prompt holding each
        temporal patch's video_token_id placeholders (`expand_video_prompt`). queue_cap: refuse the request
        (EngineOverloaded) when max_waiting_requests are already waiting, as a server must; offline callers
        that queue a whole workload at once (`LLM.generate`) pass False."""
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:
            raise RequestError(f"n must be 1 for one engine request (one sequence), got {params.n}; LLM.generate "
                               "and the server run each choice as a request of its own (SamplingParams.for_choice)")
        self.check_priority(params)
        if request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        prompt_text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids as the prompt")
            prompt_text = prompt
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            vision = self.vision_token_ids() if images is not None or videos is not None else ()
            cut = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.max_model_len, vision)
            if prompt_text is not None and len(cut) < len(prompt_ids) and self.tokenizer is not None:
                # the output's prompt is the one the model saw
                prompt_text = self.tokenizer.decode(cut, skip_special_tokens=False)
            prompt_ids = cut
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        self.check_logprobs(params)
        if params.prompt_logprobs is not None and self.num_spec_tokens:
            raise RequestError("prompt_logprobs is not supported with speculative decoding (--num-speculative-tokens)")
        biased = [t for t in (params.logit_bias or {}) if t >= vocab]
        if biased:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {biased[:5]}")
        bad_words_ids = check_token_fields(params, self.tokenizer, vocab)
        thinking_budget = thinking_budget_of(params, self.tokenizer, prompt_ids, vocab)
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {len(prompt_ids)} tokens, which leaves no room to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and asks for {max_tokens} more "
                f"({len(prompt_ids) + max_tokens} in all). Shorten the prompt or lower max_tokens.")
        if params.max_tokens is None:
            # a copy: the caller's SamplingParams may serve other prompts, whose room differs
            params = replace(params, max_tokens=max_tokens)
        if queue_cap and self.scheduler.num_unfinished >= self.config.max_waiting_requests + self.config.max_num_seqs:
            raise EngineOverloaded(f"the server is overloaded: {self.scheduler.num_unfinished} requests are "
                                   "queued or running; retry later")
        grammar = None
        if params.structured_outputs is not None:
            start = params.structured_outputs.start_token_id
            if start is not None and start >= vocab:
                raise RequestError(f"structured outputs: start_token_id must be in [0, {vocab}), got {start}")
            try:
                grammar = self.structured_output_backend().compile(params.structured_outputs)
            except StructuredOutputError as exc:
                raise RequestError(f"structured outputs: {exc}") from None
        req = Request(request_id, prompt_ids, params, eos_token_ids=self.eos_token_ids, grammar=grammar,
                      bad_words_ids=bad_words_ids, thinking_budget=thinking_budget)
        if images is not None or videos is not None:
            self._attach_vision(req, images, videos)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        self._text[request_id] = TextState(detok, StopChecker(params.stop, params.include_stop_str_in_output),
                                            prompt=prompt_text)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.num_prompt_tokens += len(prompt_ids)
        return req

    @property
    def max_logprobs(self) -> int:
        """The most log-probabilities per token a request may ask for: --max-logprobs (-1: the vocabulary
        size), and never more than the vocabulary holds."""
        vocab = self.model_config.vocab_size
        return vocab if self.config.max_logprobs < 0 else min(self.config.max_logprobs, vocab)

    def check_logprobs(self, params: SamplingParams) -> None:
        """Refuse logprobs / prompt_logprobs above max_logprobs, as vLLM does. Raises SamplingParamsError
        (its message starts with the field name)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise SamplingParamsError(f"{name} must be at most {self.max_logprobs} (the engine's "
                                          f"--max-logprobs), got {value}")

    def check_priority(self, params: SamplingParams) -> None:
        """Refuse a request priority other than 0 unless the engine schedules by priority, as vLLM does: under
        fcfs it would be silently ignored. Raises SamplingParamsError (its message starts with the field name)."""
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise SamplingParamsError(f"priority must be 0 unless the engine runs with --scheduling-policy priority "
                                      f"(this one schedules first come, first served), got {params.priority}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its caches; returns its final output (None if unknown/finished)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        # a step still in flight only matters while one of its requests is unfinished, i.e. counted here
        return self.scheduler.num_unfinished > 0

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": self.blocks.usage, "num_steps": self.num_steps,
                "num_generated_tokens": self.num_generated_tokens, "num_prompt_tokens": self.num_prompt_tokens,
                "num_preemptions": self.num_preemptions, "num_computed_prompt_tokens": self.num_computed_prompt_tokens,
                "prefix_cache_queries": self.scheduler.num_prefix_query_tokens,
                "prefix_cache_hits": self.scheduler.num_prefix_hit_tokens,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_drafts": self.num_drafts,
                **{f"spec_decode_num_accepted_tokens_pos_{i}": n for i, n in enumerate(self.num_accepted_per_pos)},
                **{f"model_steps_{kind}": n for kind, n in self.runner.step_counts.items()}}
