"""Text and UTF-8 bytes of single tokens, for the logprobs of both APIs.

A byte-level BPE token can hold part of a multi-byte character, so decoding it alone loses information.
For byte-level tokenizers the exact bytes come from the vocabulary spelling (each byte is stored as one
printable character); the text is those bytes decoded with replacement, as OpenAI reports it.
"""

from __future__ import annotations

from nibble.engine.tokenizer import Tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE byte->character map.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes (controls, space, soft hyphen...)
    are shifted to code points 256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Per-token (text, bytes), cached. Unknown ids give an empty string."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Inspect `tokenizer` once: byte-level vocabularies are read directly, others via decode."""
        self._tok = tokenizer
        self._added = tokenizer.added_tokens
        self._byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        if token_id in self._added:
            raw = self._added[token_id].encode("utf-8")
        elif self._byte_level:
            spelling = self._tok.id_to_token(token_id) or ""
            if all(c in self._alphabet for c in spelling):
                raw = bytes(self._alphabet[c] for c in spelling)
            else:
                raw = spelling.encode("utf-8")
        else:
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), raw

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text, raw bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        """The token's text (invalid UTF-8 shown as U+FFFD)."""
        return self.get(token_id)[0]

    def byte_list(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes as a list of ints (the chat logprobs `bytes` field)."""
        return list(self.get(token_id)[1])
