"""A request as the engine tracks it, and what the engine reports back per step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from nibble.engine.ngram_proposer import TokenHistory
from nibble.engine.prefix_cache import block_digests, salt_root
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.structured_output import GrammarState
from nibble.engine.thinking_budget import ThinkingBudget
from nibble.models.multimodal import ImageInputs, VideoInputs

# A fed token sampled by a step still in flight: PENDING_BASE - row, row in that step's sampled tokens.
PENDING_BASE = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the top alternatives, {token_id: logprob}; rank: the token's
    place in the vocabulary by probability (1 = the most likely), where known (prompt log-probabilities)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    `num_computed_tokens` counts the tokens of `all_token_ids` whose KV/GDN state is in the caches; the
    next step feeds `all_token_ids[num_computed_tokens:...]`. Preemption frees the caches and resets it to
    0: the request is later recomputed from its prompt plus the tokens it had generated.

    Prefix caching (prefix_cache.py): `num_cached_tokens` is how many prompt tokens came from a cached
    prefix instead of being computed; `cache_split_at`, where this prompt's prefill stops for its state to
    be cached (a block boundary that an earlier prompt shared), until the copy is taken; `cacheable`, false
    once a failed step may have left its caches half updated.

    With overlapped scheduling a step may be scheduled before the host has seen the token the step before
    it sampled: `pending_rows` holds, per such token (oldest first), its row in that step's sampled tokens.
    Pending tokens count in `num_tokens` (they are fed like known ones) but not in `output_token_ids`;
    `token_slice` returns them as `PENDING_BASE - row`, which the model runner replaces on the device.

    Speculative decoding (spec_decode.py): `draft_token_ids` are the guesses (the MTP head's, or n-gram
    lookups') of the tokens after
    the last one, fed with it in the next verify step (not part of the request's tokens); `spec_slots` are
    the GDN slots besides `state_slot` where that step leaves the states after each draft.

    Image and video input (multimodal.py): `images` / `videos` hold the preprocessed images and videos,
    `mrope_positions` int64 [3, prompt len] the prompt's 3-D rotary positions and `mrope_delta` the offset
    from token index to position of every token after the prompt; `image_embeds` [image tokens, hidden] and
    `video_embeds` [video tokens, hidden] (on the device) are the vision tower's output, computed at the first
    prefill chunk that feeds a placeholder of their kind; `cache_prompt_ids` is the prompt as the prefix cache
    keys it, each placeholder replaced by an id of its image's or video's content (`multimodal.vision_cache_ids`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    pending_rows: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None
    num_cached_tokens: int = 0
    cache_split_at: int | None = None
    cacheable: bool = True
    spec_slots: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    # n-gram drafting: the request's tokens as an array the proposer extends (ngram_proposer.py)
    token_history: TokenHistory | None = field(default=None, repr=False)
    # sampling_params.prompt_logprobs: entry p is prompt token p's (None for p = 0 and until computed)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    images: ImageInputs | None = field(default=None, repr=False)
    videos: VideoInputs | None = field(default=None, repr=False)
    mrope_positions: torch.Tensor | None = field(default=None, repr=False)
    mrope_delta: int = 0
    image_embeds: torch.Tensor | None = field(default=None, repr=False)
    video_embeds: torch.Tensor | None = field(default=None, repr=False)
    cache_prompt_ids: list[int] | None = field(default=None, repr=False)
    _block_digests: list[bytes] | None = field(default=None, repr=False)
    # (prefix index version, answer) of the last BlockManager.awaits_cut
    awaits_cut_at: tuple[int, bool] | None = field(default=None, repr=False)
    # sampling_params.bad_words as the token sequences they ban (token_masks.tokenize_bad_words)
    bad_words_ids: list[list[int]] = field(default_factory=list, repr=False)
    # sampling_params.allowed_token_ids as a device mask, bool [V] (True: banned), built at its first sampling
    allowed_ban_mask: torch.Tensor | None = field(default=None, repr=False)
    # sampling_params.thinking_token_budget when the prompt leaves the model thinking (thinking_budget.py)
    thinking_budget: ThinkingBudget | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.pending_rows)

    @property
    def has_vision(self) -> bool:
        """Whether the prompt holds images or videos (3-D positions, vision-tower rows)."""
        return self.images is not None or self.videos is not None

    @property
    def num_pending_tokens(self) -> int:
        return len(self.pending_rows)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefix_key_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it: its token ids, placeholders replaced by image and video ids."""
        return self.prompt_token_ids if self.cache_prompt_ids is None else self.cache_prompt_ids

    def block_digests(self, block_size: int) -> list[bytes]:
        """Chain digests of the prompt's full blocks (prefix_cache.block_digests of `prefix_key_ids`), computed
        once."""
        if self._block_digests is None:
            self._block_digests = block_digests(self.prefix_key_ids, block_size, root=self.digest_root)
        return self._block_digests

    @cached_property
    def digest_root(self) -> bytes:
        """Where the request's digest chain starts (prefix_cache.salt_root of its cache_salt); asked for every
        round a request waits, so hashed once."""
        return salt_root(self.sampling_params.cache_salt)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        known = p + len(self.output_token_ids)
        if end > known:
            pending = [PENDING_BASE - r for r in self.pending_rows[max(start - known, 0):end - known]]
            return self.token_slice(start, known) + pending if start < known else pending
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.finished else None


@dataclass
class CompletionOutput:
    """Cumulative output of a request so far, plus what this step added.

    While the request runs, `token_ids` and `logprobs` are the engine's own growing lists (not copies);
    a finished output owns its lists.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token, its log-probability given the ones before it (None
    # for the first), once the whole prompt is computed
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
