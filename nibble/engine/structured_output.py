"""Structured outputs: constrain sampling to a JSON schema, any JSON object, a regex, a choice of strings, a
Lark grammar or a structural tag (free text with schema-bound tagged segments, structural_tag.py) (what vLLM
calls guided decoding), through llguidance.

The grammar compiles against the model's tokenizer into a matcher per request (`GrammarBackend.compile`).
Each step, before sampling, the matchers of the rows being sampled write which tokens may come next into
a bitmask (int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 set for an allowed token t) on the
host while the device runs the forward pass; the sampler sets every other logit to -inf
(`apply_token_bitmask`); the sampled token then advances the matcher (`GrammarState.accept`). A matcher
that can take nothing but an end-of-sequence token finishes its request at once ("stop"), without spending
a step on the end token.

For a thinking model the constraint can start after the reasoning: `StructuredOutputsParams.start_token_id`
(the server passes the id of `</think>` when the chat prompt leaves the model thinking), so the model
reasons freely and the answer after it follows the grammar.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from nibble.engine.structural_tag import StructuralTagError, structural_tag_grammar

# JSON compiler options: no free whitespace between tokens (as vLLM's default backends), so a sampled
# answer cannot run on as whitespace until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
# A choice list is compiled into one regex; bound its size like the other per-request lists.
MAX_CHOICES = 1024
MAX_COMPILED = 128  # compiled grammars a GrammarBackend keeps
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_REGEX_META = re.compile(r"([\\.^$|?*+()\[\]{}\-/#&~\"])")


class StructuredOutputError(ValueError):
    """A constraint that cannot be used (bad schema, regex or grammar; several kinds at once); the
    message names the field."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings, exactly), `grammar` (Lark syntax, or GBNF, which
    is converted) or `structural_tag` (vLLM's spec, a dict or its JSON text: structural_tag.py).
    start_token_id: the constraint applies only after the model has generated this token (None: from the
    first generated token)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    start_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, str) or (self.choice is not None and not isinstance(self.choice, (list, tuple))):
            raise StructuredOutputError(f"choice must be a list of strings, got {type(self.choice).__name__}")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputError(f"json_object must be true or false, got {self.json_object!r}")
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise StructuredOutputError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got " + (", ".join(kinds) if kinds
                                                                                      else "none"))
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise StructuredOutputError(f"choice must have at most {MAX_CHOICES} entries, got {len(self.choice)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputError(f"{name} must be a non-empty string")
        if self.start_token_id is not None and (not isinstance(self.start_token_id, int) or self.start_token_id < 0):
            raise StructuredOutputError(f"start_token_id must be a token id, got {self.start_token_id!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a core dependency; only a broken install gets here
        raise StructuredOutputError("structured outputs need the llguidance package (pip install llguidance)") \
            from exc
    return llguidance


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of `choices` (regex metacharacters escaped)."""
    return "(" + "|".join(_REGEX_META.sub(r"\\\1", c) for c in choices) + ")"


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet checked against a tokenizer)."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
                raise StructuredOutputError(f"json: the schema is not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"json: a schema must be a JSON object, got {type(schema).__name__}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredOutputError(f"json: {exc}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_regex(choice_regex(params.choice or ()))
    if kind == "structural_tag":
        assert params.structural_tag is not None
        try:
            return llg.LLMatcher.grammar_from_lark(structural_tag_grammar(params.structural_tag))
        except StructuralTagError as exc:
            raise StructuredOutputError(f"structural_tag: {exc}") from None
    text = params.grammar or ""
    if "::=" in text:  # GBNF (llama.cpp / xgrammar EBNF), what vLLM's default backend takes
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain Exceptions on syntax errors
            raise StructuredOutputError(f"grammar: {exc}") from None
    return llg.LLMatcher.grammar_from_lark(text)


class GrammarState:
    """The matcher of one request and whether its constraint has started (see `start_token_id`)."""

    def __init__(self, matcher: Any, start_token_id: int | None) -> None:
        self.matcher = matcher
        self.start_token_id = start_token_id
        self.started = start_token_id is None  # whether the next token is constrained

    def accept(self, token_id: int) -> str | None:
        """Advance by a sampled token; returns None to continue, "stopped" when the grammar is complete
        and can take no more text, or an error message when the token broke the grammar."""
        if not self.started:
            self.started = token_id == self.start_token_id
            return None
        if not self.matcher.consume_token(token_id):
            return self.matcher.get_error() or f"token {token_id} is not allowed by the grammar"
        return "stopped" if self.matcher.is_stopped() else None


class GrammarBackend:
    """llguidance's view of one tokenizer: compiles constraints into `GrammarState`s and fills bitmasks.

    vocab_size: the model's (logits') vocabulary, which may be larger than the tokenizer's; ids beyond the
    tokenizer are never allowed. eos_token_ids: every id that ends a generation, allowed once the grammar
    is complete. Building the tokenizer view takes ~1.5 s for a 248k vocabulary: `prepare()` does it ahead.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """tokenizer: a `tokenizers.Tokenizer`, serialised for llguidance only when `prepare()` runs."""
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._lltok: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @property
    def num_words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def prepare(self) -> None:
        """Build llguidance's tokenizer view now (idempotent, thread-safe)."""
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                self._lltok = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self._eos or None)
                self._executor = llg.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> GrammarState:
        """Check `params` against the tokenizer and start a matcher. Raises StructuredOutputError naming the
        field and quoting llguidance's reason.

        Compiled grammars are kept (the last MAX_COMPILED, by grammar text) and each request gets a copy of
        the untouched matcher: the server's validating compile, the engine's compile of the same request
        (on the engine thread, where a compile holds back every running request) and later requests with
        the same schema or tools cost a copy (tens of µs) instead of a compile (milliseconds, more for large
        tool lists)."""
        self.prepare()
        llg = _llguidance()
        source = grammar_source(params)
        with self._lock:
            base = self._compiled.get(source)
            if base is not None:
                self._compiled.move_to_end(source)
                return GrammarState(base.deep_copy(), params.start_token_id)
        error = llg.LLMatcher.validate_grammar(source, self._lltok)
        if error:
            raise StructuredOutputError(f"{params.kind}: {error.strip()}")
        matcher = llg.LLMatcher(self._lltok, source, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"{params.kind}: {matcher.get_error()}")
        with self._lock:
            self._compiled[source] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return GrammarState(matcher.deep_copy(), params.start_token_id)

    def fill_bitmask(self, states: list[GrammarState]) -> torch.Tensor:
        """int32 [len(states), num_words] on the host (pinned when CUDA is there): row i = the tokens
        `states[i]` allows next."""
        pin = torch.cuda.is_available()
        mask = torch.empty((len(states), self.num_words), dtype=torch.int32, pin_memory=pin)
        row_bytes = self.num_words * 4
        # the executor fills the rows on its own threads, without the GIL
        self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], mask.data_ptr(),
                                               row_bytes, len(states))
        return mask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the tokens a bitmask row does not allow. logits: [B, V];
    rows: int64 [R] (rows of logits); bitmask: int32 [R, ceil(V / 32)] on the logits' device."""
    vocab = logits.shape[-1]
    if bitmask.shape != (rows.shape[0], (vocab + 31) // 32):
        raise ValueError(f"bitmask must be [{rows.shape[0]}, {(vocab + 31) // 32}], got {list(bitmask.shape)}")
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_reference(logits: torch.Tensor, rows: list[int], allowed: list[set[int]]) -> torch.Tensor:
    """What `apply_token_bitmask` computes, from explicit allowed-token sets (tests)."""
    out = logits.clone()
    for r, ids in zip(rows, allowed):
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[sorted(ids)] = True
        out[r] = out[r].masked_fill(~keep.to(logits.device), float("-inf"))
    return out
