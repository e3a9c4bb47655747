"""LLMEngine: the synchronous core. `add_request` validates and queues, `step` schedules one batch, runs
the model, samples, detokenizes incrementally, applies stop conditions and reports per-request outputs.

Overlapped scheduling (`EngineConfig.async_scheduling`, on by default): once a step's model and sampling
work is queued on the device, `step` schedules and queues the next one before it waits for the sampled
tokens, feeding them to the next step on the device (the requests' pending tokens, request.py), and then
detokenizes and reports while the device runs that next step. So the host's work between two decode
steps no longer leaves the GPU idle; only decode steps are queued ahead (see `_can_overlap`). A request
that stops (EOS, stop string, error, abort) has its row of the step already queued discarded; requests
reaching max_tokens are not scheduled again. Off under tensor parallelism.

Speculative decoding (`EngineConfig.num_speculative_tokens`, the MTP head or n-gram lookup drafting): every
step runs to the end before the next is scheduled (`_spec_step`), since a verify step's accepted count moves
the positions of the next; a decoding request gets up to num_speculative_tokens + 1 tokens per step. The MTP
head's drafts come back with the step; n-gram drafts are looked up here, in the request's tokens.

Penalties (repetition/presence/frequency), structured outputs and bad words of several tokens need the token
of the step before on the host: the sampler counts it, the grammar's matcher must have taken it before it can
say which tokens come next, a bad word's last token is banned only right after its other tokens; so does the
one step that samples the token a thinking budget may force. While a request uses them (that step only, for
the budget), the queued step's forward pass still goes ahead, but its sampling is deferred
(`_Launched.logits`) until the host has handled the step before; the GPU keeps running the forward pass
meanwhile, and sampling queues behind it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nibble.checkpoint.demo import resolve_model_path
from nibble.checkpoint.loader import load_model
from nibble.engine.block_manager import BlockManager
from nibble.engine.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.detokenizer import IncrementalDetokenizer, StopChecker
from nibble.engine.errors import EngineOverloaded, RequestError
from nibble.engine.generation_config import GenerationConfigError, load_generation_defaults
from nibble.engine.image_requests import ImageArg, ImageRequests, VideoArg, vision_max_patches
from nibble.engine.kernels import select_engine_kernels
from nibble.engine.model_runner import ModelRunner, num_mtp_layers
from nibble.engine.ngram_proposer import NgramProposer
from nibble.engine.outputs import TextState, request_output, store_prompt_logprobs
from nibble.engine.parallel import WorkerError, WorkerGroup
from nibble.engine.request import Request, RequestOutput, RequestStatus, TokenLogprobs
from nibble.engine.sampler import PendingSample, sample_launch
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from nibble.engine.scheduler import ScheduledBatch, Scheduler
from nibble.engine.spec_sampler import needs_full_sampler
from nibble.engine.structured_output import GrammarBackend, StructuredOutputError
from nibble.engine.thinking_budget import thinking_budget_of
from nibble.engine.token_masks import check_token_fields, needs_token_context
from nibble.engine.tokenizer import Tokenizer
from nibble.engine.vision_prompts import VisionPrompts
from nibble.engine.warmup import warm_up
from nibble.models.config import ModelConfig
from nibble.models.quant_config import QuantConfigError, check_quantization

logger = logging.getLogger("nibble.engine")

DEFAULT_MAX_MODEL_LEN = 32768


@dataclass
class _Launched:
    """A step queued on the device (`step`: its number; `sched`: its batch): the requests whose rows were
    sampled (in row order) and their tokens; or, while its sampling is deferred, its logits [rows, V]."""

    step: int
    sched: ScheduledBatch
    sampled: list[Request]
    pending: PendingSample | None
    logits: torch.Tensor | None = None


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


class LLMEngine(VisionPrompts):
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
        # a verify step holds blocks for 2k positions past the computed tokens (scheduler._alloc_len)
        capacity = self.blocks.num_usable_blocks * config.block_size - 2 * self.num_spec_tokens
        if capacity < max_model_len:
            logger.warning("KV cache holds %d tokens; max_model_len lowered from %d to %d",
                           capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_spec_tokens=self.num_spec_tokens, policy=config.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self._text: dict[str, TextState] = {}
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(config.seed)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids)
                                          | set(self.generation_defaults.eos_token_ids or ())
                                          | set(self.tokenizer.eos_token_ids if self.tokenizer else ())))
        self._inflight: _Launched | None = None
        self._step_error: Exception | None = None
        self._grammars = (GrammarBackend(self.tokenizer.backend, self.model_config.vocab_size, self.eos_token_ids)
                          if self.tokenizer is not None else None)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
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
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
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
                    images: ImageArg | None = None, videos: VideoArg | None = None) -> Request:
        """Validate and queue a request. Raises RequestError (or SamplingParamsError) on bad input.

        images: the prompt's images, preprocessed (`vision_processor.preprocess_images`' (pixel_values,
        grid_thw), or a list of `ProcessedImage`), in prompt order; the prompt must then hold one
        image_token_id placeholder per image token (`expand_image_prompt`). videos: likewise its videos
        (`VideoInputs`, a list of `ProcessedVideo`, or (pixel_values, grid_thw)), the prompt holding each
        temporal patch's video_token_id placeholders (`expand_video_prompt`)."""
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
        if self.scheduler.num_unfinished >= self.config.max_waiting_requests + self.config.max_num_seqs:
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
                "num_preemptions": self.num_preemptions,
                "prefix_cache_queries": self.scheduler.num_prefix_query_tokens,
                "prefix_cache_hits": self.scheduler.num_prefix_hit_tokens,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_drafts": self.num_drafts,
                **{f"spec_decode_num_accepted_tokens_pos_{i}": n for i, n in enumerate(self.num_accepted_per_pos)},
                **{f"model_steps_{kind}": n for kind, n in self.runner.step_counts.items()}}

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for each request that advanced or finished. With
        overlapped scheduling the outputs are those of the step queued by the previous call, and this call
        leaves the next step running on the device."""
        if self._step_error is not None:
            error, self._step_error = self._step_error, None
            raise error
        if self.num_spec_tokens:
            return self._spec_step()
        try:
            cur = self._inflight or self._launch(None)
            self._inflight = None
            if cur is None:
                return []
            if self._can_overlap():
                self._inflight = self._launch(cur, defer_sampling=self._needs_host_tokens())
            outputs = self._finish_step(cur)
        except BaseException as exc:
            self._abandon_steps()
            self._fail_workers(exc)
            raise
        if self._inflight is not None and self._inflight.logits is not None:
            try:
                self._sample_deferred(self._inflight)
            except Exception as exc:
                # cur's outputs (final ones among them) are out of the engine's books already: deliver them,
                # and fail the next call instead
                self._abandon_steps()
                self._step_error = exc
        return outputs

    def _spec_step(self) -> list[RequestOutput]:
        """One step under speculative decoding (spec_decode.py), run to the end before returning: the next
        step's positions depend on how many drafts this one accepts."""
        sched = self.scheduler.schedule()
        self.num_preemptions += sched.num_preempted
        if sched.empty:
            return []
        self.num_steps += 1
        drafted = {i for i, r in enumerate(sched.requests) if not needs_full_sampler(r)}
        try:
            out = self.runner.execute_spec(sched, self._generator, self._bitmask)
        except BaseException as exc:
            self._abandon_steps()
            self._fail_workers(exc)
            raise
        if not sched.spec_verify:
            for req, n in zip(sched.requests, sched.num_new_tokens):
                req.num_computed_tokens += n
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for j, i in enumerate(out.rows):
            req = sched.requests[i]
            if req.finished:
                continue
            tokens = out.tokens[j]
            context = req.num_computed_tokens
            group = [req.state_slot, *req.spec_slots]
            if sched.spec_verify and i in drafted:
                self.num_draft_tokens += self.num_spec_tokens
                self.num_accepted_tokens += len(tokens) - 1
                self.num_drafts += 1
                for pos in range(len(tokens) - 1):
                    self.num_accepted_per_pos[pos] += 1
            if j in out.bad_rows:
                outputs.append(self._fail_non_finite(req, self.num_steps, sched))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            for t, token in enumerate(tokens):
                if sched.spec_verify:
                    # token t follows the last token and t accepted drafts: that is what the caches hold when
                    # it is appended, so a request ending here leaves a consistent prefix-cache entry
                    req.num_computed_tokens = context + 1 + t
                    self.blocks.accept_spec_state(req, group, t)  # type: ignore[arg-type]
                lps = out.logprobs[j]
                self._append_token(req, token, lps[t] if lps is not None else None)
                if req.finished:
                    break
            if not req.finished:
                req.draft_token_ids = self.ngram.propose(req) if self.ngram is not None else out.drafts[j]
            outputs.append(self._output(req))
        return outputs

    def _abandon_steps(self) -> None:
        """After a step failed: forget the step in flight and every pending token, and keep nothing of this
        state for the prefix cache (a failed step may have left caches half updated, or entries whose state
        copies never ran)."""
        self._inflight = None
        for req in self.requests.values():
            req.pending_rows.clear()
            req.cacheable = False
        self.blocks.clear_prefix_cache()

    def _fail_workers(self, exc: BaseException) -> None:
        """Under tensor parallelism a step that failed on this rank may have left the others inside a collective
        this rank never reaches: they are stopped and WorkerError raised (fatal: the server's engine thread ends
        and answers every request), where serving on would hang at the next step."""
        if self.workers is None or (isinstance(exc, WorkerError) and self.workers.failed):
            return
        reason = f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the workers were stopped"
        self.workers.fail(reason)
        if isinstance(exc, Exception):  # KeyboardInterrupt and the like go on as they are
            raise WorkerError(reason) from exc

    def _can_overlap(self) -> bool:
        """Whether to queue the next step before this one's tokens are seen: only when it will be a pure
        decode step (a CUDA-graph replay, quick to queue). Queuing an eager prefill chunk is itself long host
        work (about a thousand launches) that would hold back the delivery of this step's tokens, for little
        gain: the host work it hides is small next to a prefill chunk's GPU time."""
        sched = self.scheduler
        return (self.config.async_scheduling and self.workers is None and not sched.waiting
                and all(r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running))

    def _needs_host_tokens(self) -> bool:
        """Whether a running request samples from its earlier tokens (penalties, a grammar's matcher, bad words
        of several tokens, a thinking budget reached)."""
        return any(r.sampling_params.needs_penalties or r.grammar is not None or needs_token_context(r)
                   for r in self.scheduler.running)

    def _launch(self, inflight: _Launched | None, defer_sampling: bool = False) -> _Launched | None:
        """Schedule a batch and queue its model work and, unless defer_sampling, its sampling; `inflight`:
        the step before it, whose sampled tokens are still on the device."""
        sched = self.scheduler.schedule()
        self.num_preemptions += sched.num_preempted
        if sched.empty:
            return None
        self.num_steps += 1
        tokens = inflight.pending.token_ids if inflight is not None and inflight.pending is not None else None
        logits, rows = self.runner.execute(sched, tokens)
        for i, (first, entries) in self.runner.prompt_logprob_results.items():
            store_prompt_logprobs(sched.requests[i], first, entries)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            req.num_computed_tokens += n
        if logits is None:
            return _Launched(self.num_steps, sched, [], None)
        sampled = [sched.requests[i] for i in rows]
        launched = _Launched(self.num_steps, sched, sampled, None, logits if defer_sampling else None)
        if not defer_sampling:
            launched.pending = sample_launch(logits, sampled, self._generator, self._bitmask(sampled))
        for j, req in enumerate(sampled):
            req.pending_rows.append(j)
        return launched

    def _sample_deferred(self, launched: _Launched) -> None:
        """Queue the sampling of a step launched with defer_sampling, now that the host has handled the step
        before it (its tokens are in the requests' outputs and grammars)."""
        assert launched.logits is not None
        launched.pending = sample_launch(launched.logits, launched.sampled, self._generator,
                                         self._bitmask(launched.sampled), own_pending=1)
        launched.logits = None

    def _bitmask(self, sampled: list[Request]) -> tuple[list[int], torch.Tensor] | None:
        """The structured-output bitmask of the sampled rows under a constraint (their rows, int32 [rows,
        words] on the host), computed while the device runs the step's forward pass."""
        rows = [j for j, r in enumerate(sampled) if r.grammar is not None and r.grammar.started and not r.finished]
        if not rows or self._grammars is None:
            return None
        return rows, self._grammars.fill_bitmask([sampled[j].grammar for j in rows])  # type: ignore[misc]

    def _finish_step(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a step's sampled tokens and hand them to their requests (stop conditions, text)."""
        if launched.pending is None:
            return []
        result = launched.pending.result()
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for j, req in enumerate(launched.sampled):
            if req.finished:
                continue  # stopped or aborted after this step was queued
            if req.pending_rows:
                req.pending_rows.pop(0)
            if j in result.bad_rows:
                outputs.append(self._fail_non_finite(req, launched.step, launched.sched))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            self._append_token(req, result.token_ids[j], result.logprobs[j])
            outputs.append(self._output(req))
        return outputs

    def _fail_non_finite(self, req: Request, step: int, sched: ScheduledBatch) -> RequestOutput:
        """End a request whose row of engine step `step` had non-finite logits; its final output."""
        req.error = (f"the model produced non-finite logits (NaN/Inf) at engine step {step} for this request; "
                     "generation stopped")
        logger.error("non-finite logits: request %s, step %d, batch of %d sequences (%d tokens)",
                     req.request_id, step, len(sched.requests), sched.num_tokens)
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._output(req)

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        sp = req.sampling_params
        req.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        state = self._text[req.request_id]
        status: RequestStatus | None = None
        enough = req.num_output_tokens >= sp.min_tokens
        if enough and token in sp.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif enough and not sp.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        grammar = req.grammar.accept(token) if req.grammar is not None else None
        if grammar is not None and grammar != "stopped":
            req.error = f"structured output: the sampled token broke the grammar ({grammar})"
            logger.error("request %s: %s", req.request_id, req.error)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            return
        if status is None and state.feed(token, check_stop=enough):
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, state.stop.matched
        if status is None and grammar == "stopped":
            status = RequestStatus.FINISHED_STOPPED
        # a pending token (of a step still in flight) is not part of this request's length yet
        length = req.num_prompt_tokens + req.num_output_tokens
        if status is None and (req.num_output_tokens >= (sp.max_tokens or 0) or length >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            state.finish()
            self.scheduler.finish(req, status)

    def _output(self, req: Request) -> RequestOutput:
        out = request_output(req, self._text[req.request_id])
        if req.finished:
            self.requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
        return out
