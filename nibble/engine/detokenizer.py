"""Streaming detokenization and stop-string matching.

`IncrementalDetokenizer` turns generated ids into text one step at a time. With byte-level BPE one
character can be split across tokens (a CJK character is three bytes, an emoji four), so a step's text may
end in an incomplete character that decodes to U+FFFD; that tail is held back until later tokens complete it.
Only a small window of recent ids is decoded per step, so the cost does not grow with the output length.

`StopChecker` finds stop strings in the emitted text, holding back any tail that could still grow into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, delivered in complete pieces.

    The concatenation of everything `step` and `flush` return equals `tokenizer.decode(generated_ids,
    skip_special_tokens)` exactly. `prompt_ids` are kept (as `prompt_ids`) for callers that echo the
    prompt; decoding starts at the first generated token so that the result is the generated text alone.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """`tokenizer` needs only `decode(ids, skip_special_tokens)` (nibble's `Tokenizer` has it)."""
        self._tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        # Invariant: ids[:_prefix] and ids[:_read] both end on a character boundary, the text of ids[:_read]
        # has been emitted, and ids[_prefix:_read] is decoded again each step as the shared prefix whose
        # text is subtracted from the window's text.
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated ids and return the newly completed text ('' while a character is unfinished)."""
        self.token_ids.extend(new_token_ids)
        if self._read == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        window_text = self._decode(self.token_ids[self._prefix :])
        # A trailing U+FFFD is either an incomplete character (resolved by the next tokens) or a genuine
        # invalid byte; both are held, and `flush` releases whatever is left at the end.
        if window_text.endswith(_REPLACEMENT) or len(window_text) < len(prefix_text):
            return ""
        new_text = window_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self.token_ids)
        self.output_text += new_text
        return new_text

    def flush(self) -> str:
        """Return the text still held back (an unresolved U+FFFD tail); call once the sequence is done."""
        if self._read == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        window_text = self._decode(self.token_ids[self._prefix :])
        new_text = window_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self.token_ids)
        self.output_text += new_text
        return new_text


class StopChecker:
    """Cuts streamed text at the first stop string, which may arrive split across several pieces.

    Text that could be the start of a stop string is held back until it is either completed (stop) or
    ruled out (emitted). When several stop strings match, the one that ends first wins, as it would when
    checking after every character; among those ending at the same place, the one starting earliest.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """`stop`: the stop strings (non-empty); `include_stop_str_in_output` keeps the match in the text."""
        stops = list(dict.fromkeys(stop))
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        self._max_len = max((len(s) for s in stops), default=0)

    def process(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of text; return (text safe to emit now, whether a stop string matched).

        After a match, further calls return ('', True).
        """
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            # Only a match overlapping the new text can be new: held text alone matched nothing before.
            start = buf.find(s, max(0, len(self._held) - len(s) + 1))
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand < best:
                    best = cand
        if best is not None:
            end, start, s = best
            self.stopped = True
            self.matched = s
            self._held = ""
            return (buf[:end] if self.include_stop_str_in_output else buf[:start]), True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string.
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (eos, length)."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return out
