"""Offline batch inference in the vLLM convention: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Images and videos (models with a vision tower): a prompt dict's `multi_modal_data` {"image": one image or a
list, "video": one video or a list}, with one placeholder per image and per video in the prompt
(`<|vision_start|><|image_pad|><|vision_end|>`, `<|vision_start|><|video_pad|><|vision_end|>`, as the chat
template writes them), as vLLM takes them. An image is a PIL image, an RGB uint8 array [H, W, 3], encoded
bytes or a data-URL string; a video is an RGB uint8 array [T, H, W, 3] of sampled frames, a list of frames
(inside the list of videos: {"video": [[frame, ...]]}), (frames, metadata) or an encoded video (bytes, a
data:video URL; decoded with PyAV: models/video_decode.py);
either may be an http(s):// or file:// URL, fetched under the engine's media policy (engine/media.py,
`allowed_local_media_path` for file://). `chat` takes {"type": "image_url", "image_url": {"url": ...}},
{"type": "video_url", "video_url": {"url": ...}}, {"type": "image", "image": ...} and
{"type": "video", "video": ...} content parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from nibble.engine.config import EngineConfig, parse_speculative_config
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.tokenizer import Tokenizer
from nibble.models.multimodal import take_media

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """A model loaded for offline generation.

    LLM(model="demo" | DIR, device="auto"|"cpu"|"cuda", dtype="auto"|"bfloat16"|"float32", **engine options);
    any EngineConfig field can be given as a keyword, and speculative_config as vLLM's dict ({"method": "mtp" |
    "ngram", "num_speculative_tokens": k, ...}).
    """

    def __init__(self, model: str = "demo", device: str = "auto", dtype: str = "auto", **kwargs: Any) -> None:
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            kwargs = {**parse_speculative_config(spec), **kwargs}
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **kwargs))
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache, as vLLM's LLM.reset_prefix_cache (LLMEngine.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams holding the request defaults of the engine's generation config (the model's
        generation_config.json unless `generation_config` / `override_generation_config` say otherwise), what
        `generate` uses when given none, as vLLM's LLM does."""
        return SamplingParams(**self.engine.generation_defaults.sampling_params_kwargs())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list: text, token-id lists, or {"prompt": ...}/{"prompt_token_ids": ...}.
        Without sampling_params, `get_default_sampling_params()`. priority: one per prompt, as vLLM's (needs
        scheduling_policy="priority" unless all 0; replaces the SamplingParams' own). Returns one RequestOutput
        per prompt, in order."""
        items = self._normalize(prompts)
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        else:
            params = [sampling_params or self.get_default_sampling_params() for _ in items]
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"got {len(priority)} priorities for {len(items)} prompts")
        copies = [_copy(sp) for sp in params]
        for i, copy in enumerate(copies):
            if priority is not None:
                copy.priority = priority[i]
            self.engine.check_priority(copy)
        # per prompt, its choices' engine requests (n > 1: one request per choice, as vLLM fans them out)
        groups: list[list[str]] = []
        first = self._counter + 1
        try:
            for p, copy in zip(items, copies):
                self._counter += 1
                prompt, raw_images, raw_videos = p
                images = videos = None
                if raw_images or raw_videos:
                    prompt, images, videos = self.engine.prepare_media(prompt, raw_images, raw_videos)
                group: list[str] = []
                groups.append(group)
                for j in range(copy.n):
                    rid = f"offline-{self._counter}" if copy.n == 1 else f"offline-{self._counter}-{j}"
                    self.engine.add_request(rid, prompt, copy.for_choice(j) if copy.n > 1 else copy,
                                            images=images, videos=videos, queue_cap=False)
                    group.append(rid)
        except Exception:
            # a prompt the engine refuses: the ones before it must not stay queued for the next call
            for rid in (r for group in groups for r in group):
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(len(g) for g in groups), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [_merge_choices([results[r] for r in group], f"offline-{first + i}") for i, group in enumerate(groups)]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, enable_thinking: bool | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, use_tqdm: bool = False,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate. continue_final_message (with
        add_generation_prompt=False, as in vLLM): generation continues the last (assistant) message instead of
        starting a new turn."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        tok = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conv in conversations:
            conv, images, videos = take_media(conv)  # type: ignore[arg-type]
            text = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                           enable_thinking=enable_thinking,
                                           continue_final_message=continue_final_message,
                                           **(chat_template_kwargs or {}))
            media = {"image": images, "video": videos}
            prompts.append({"prompt": text, "multi_modal_data": media} if images or videos else text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _normalize(prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | list[int], list[Any], list[Any]]]:
        """(prompt, its raw images, its raw videos) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        out: list[tuple[str | list[int], list[Any], list[Any]]] = []
        for p in prompts:  # type: ignore[union-attr]
            if isinstance(p, dict):
                data = p.get("multi_modal_data") or {}
                image, video = data.get("image"), data.get("video")
                images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
                # one video may itself be a (frames, metadata) tuple; any other list or tuple lists videos
                single = not isinstance(video, (list, tuple)) or _is_video_with_metadata(video)
                videos = [] if video is None else [video] if single else list(video)
                if "prompt_token_ids" in p:
                    out.append((list(p["prompt_token_ids"]), images, videos))
                elif "prompt" in p:
                    out.append((str(p["prompt"]), images, videos))
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(p, str):
                out.append((p, [], []))
            else:
                out.append((list(p), [], []))
        return out


def _is_video_with_metadata(video: Any) -> bool:
    return isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict)


def _merge_choices(outs: list[RequestOutput], request_id: str) -> RequestOutput:
    """One prompt's RequestOutput (request_id) from its choices' (parallel sampling): the first one's, holding
    every choice's CompletionOutput, indexed 0..n-1, and the first error any of them met."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    choices = []
    for j, out in enumerate(outs):
        choice = out.outputs[0]
        choice.index = j
        choices.append(choice)
    error = next((o.error for o in outs if o.error), None)
    return replace(first, request_id=request_id, outputs=choices, error=error)


def _copy(sp: SamplingParams) -> SamplingParams:
    return replace(sp, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids))
