"""SamplingParams in the vLLM convention, validated on construction."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from nibble.engine.structured_output import StructuredOutputsParams

# Each stop token id is checked against every sampled token of the request: bound the list a client sends.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
# bad_words are matched against the generated tokens of every sampled row on the engine thread: bound the list
# (vLLM's own limit is 128 words).
MAX_BAD_WORDS = 128
# Seeds the sampler's torch.Generator accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class SamplingParamsError(ValueError):
    """An invalid sampling setting; the message names the field."""


@dataclass
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k <= 0 disables top-k; top_p 1 and min_p 0 disable those filters.
    logprobs: number of top log-probabilities to return per generated token (None = none; the sampled
    token's own log-probability is included whenever logprobs is not None).
    prompt_logprobs: the same for every prompt token after the first (the model's log-probability of each
    prompt token given the ones before it, as lm-eval's loglikelihood tasks use); such a request computes its
    whole prompt (no prefix-cache hit).
    logit_bias: token id -> value in [-100, 100] added to its logit before sampling (OpenAI's field; -100
    bans a token, +100 all but forces it).
    structured_outputs: a constraint the output must follow (JSON schema, regex, choice, grammar;
    structured_output.py). The grammar decides where the output ends, so min_tokens must stay 0.
    cache_salt: requests share prefix-cache entries only with requests of the same salt (vLLM's field: one
    salt per tenant keeps tenants from learning, through the time to first token, what others sent).
    priority: vLLM's request priority under `--scheduling-policy priority` (lower values are served first, ties
    by arrival; the engine refuses anything but 0 under fcfs). vLLM takes it beside the sampling parameters;
    here it travels with them, so that every endpoint's way into the engine carries it.
    allowed_token_ids: vLLM's field: only these token ids may be sampled (a non-empty list; the engine checks
    them against the vocabulary).
    bad_words: vLLM's field: words the output must not contain. The engine tokenizes each as vLLM does (as
    written and with a leading space); a one-token word is never sampled, a longer one's last token is not
    sampled right after its other tokens (token_masks.py).
    truncate_prompt_tokens: vLLM's field: keep only the last k prompt tokens (-1: the engine's max_model_len).
    thinking_token_budget: vLLM's field: when the prompt leaves the model thinking, at most this many tokens are
    generated before `</think>`, which is then forced (thinking_budget.py); max_tokens still applies.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    priority: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.allowed_token_ids, (tuple, set)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (list, tuple)):
            # an empty list bans nothing, as in vLLM (whose default it is)
            self.bad_words = list(self.bad_words) or None
        self.validate()

    def validate(self) -> None:
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(f"{name} {msg}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n", "must be an integer >= 1")
        check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k <= 0 or self.top_k >= 1), "top_k", "must be an integer")
        check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
              "must be in [-2, 2]")
        check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
              "must be in [-2, 2]")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be >= 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""), "cache_salt",
              "must be a non-empty string")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        # the upper bound is the engine's --max-logprobs (LLMEngine.check_logprobs)
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs",
              "must be an integer >= 0")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
              "prompt_logprobs", "must be an integer >= 0")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(isinstance(self.priority, int) and not isinstance(self.priority, bool), "priority", "must be an integer")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # not via check(): its message would print the list
            raise SamplingParamsError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got "
                                      f"{len(self.stop_token_ids)}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got "
                                          f"{len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise SamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not (_finite(bias) and -100 <= bias <= 100):
                    raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {bias!r} for token "
                                              f"{token}")

        self._validate_token_fields()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams, got "
                                          f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise SamplingParamsError("min_tokens cannot be combined with structured outputs (the grammar "
                                          f"decides where the output ends), got {self.min_tokens}")

    def _validate_token_fields(self) -> None:
        """allowed_token_ids, bad_words, truncate_prompt_tokens and thinking_token_budget; the messages quote at
        most a few entries of the lists, which may be long."""
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed:
                raise SamplingParamsError("allowed_token_ids must be a non-empty list of token ids")
            bad = [t for t in allowed if not isinstance(t, int) or isinstance(t, bool) or t < 0]
            if bad:
                raise SamplingParamsError(f"allowed_token_ids must be token ids (integers >= 0), got {bad[:5]}")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise SamplingParamsError("bad_words must be a list of strings")
            if len(words) > MAX_BAD_WORDS:
                raise SamplingParamsError(f"bad_words must have at most {MAX_BAD_WORDS} entries, got {len(words)}")
            blank = [w for w in words if not w.strip()]
            if blank:
                raise SamplingParamsError(f"bad_words entries must not be empty or only whitespace, got {blank[0]!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            raise SamplingParamsError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for the model's "
                                      f"maximum length, got {k!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise SamplingParamsError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n (parallel sampling: each choice is its own engine request): a
        copy with n = 1 (the engine completes max_tokens in place) and, when a seed is given, seed + index, so
        that seeded choices differ from each other and stay reproducible."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > SEED_MAX:
                seed -= SEED_MAX - SEED_MIN + 1
        return replace(self, n=1, seed=seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))


def truncate_prompt(prompt_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int,
                    vision_token_ids: Collection[int] = ()) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of a prompt (-1: max_model_len of them), as vLLM truncates
    (from the left); the prompt itself when it is no longer or the field is None. SamplingParamsError when k
    exceeds max_model_len, as in vLLM, or when the cut would drop placeholders of an image or a video
    (`vision_token_ids`): what is left of it would no longer match its pixels."""
    k = truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise SamplingParamsError(f"truncate_prompt_tokens must be at most the maximum context length "
                                  f"({max_model_len}), got {k}")
    if len(prompt_ids) <= k:
        return prompt_ids
    cut = len(prompt_ids) - k
    if vision_token_ids and not set(vision_token_ids).isdisjoint(prompt_ids[:cut]):
        raise SamplingParamsError(f"truncate_prompt_tokens {k} would cut into an image or video of the prompt (it "
                                  f"has {len(prompt_ids)} tokens); keep at least the tokens from its first one on")
    return prompt_ids[cut:]
