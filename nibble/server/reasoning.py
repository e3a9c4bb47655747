"""Split Qwen3 / Qwen3.5 output into `reasoning_content` and `content`.

With thinking on, the Qwen3.5 template ends the prompt with `<think>\\n`, so the generated text starts
inside the reasoning and has no opening tag; `</think>` ends it, and what follows (after the template's
blank line) is the answer. Should the model repeat the opening `<think>` anyway, it is dropped. With
thinking off, the prompt already holds an empty think block and all output is content.

Whitespace follows what the template does when the turn is sent back in a later request: reasoning is
trimmed, and the newlines between `</think>` and the answer are dropped. Reasoning cut off by the token
limit (no `</think>`) is all reasoning and no content.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def extract(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """Non-streaming split of a complete output into (reasoning, content); empty parts are None."""
    if not thinking:
        return None, text or None
    body = text.lstrip()
    if body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    reasoning, found, content = body.partition(THINK_END)
    content = content.lstrip("\n") if found else ""
    return reasoning.strip() or None, content or None


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamParser:
    """Streaming form of `extract`: feed text deltas, get (reasoning_delta, content_delta) pairs.

    Tags split across deltas are recognised; text that might be part of a tag, and whitespace that might
    turn out to be trimmed, is held back until it is resolved or `finish` is called. Concatenating every
    returned reasoning (content) delta gives exactly `extract(full_text, thinking)`'s reasoning (content).
    """

    _OPEN = "open"  # before any reasoning text: an opening <think> may still come
    _REASONING = "reasoning"
    _AFTER_END = "after_end"  # just after </think>: newlines are dropped
    _CONTENT = "content"

    def __init__(self, thinking: bool) -> None:
        """`thinking`: whether the prompt was rendered with thinking on (enable_thinking not false)."""
        self.thinking = thinking
        self._state = self._OPEN if thinking else self._CONTENT
        self._buf = ""
        self._reasoning_started = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning part."""
        return self._state in (self._OPEN, self._REASONING)

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        """Process the next text delta; returns (reasoning_delta, content_delta), each None when empty."""
        if self._state == self._CONTENT:
            return None, delta or None
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        if self._state == self._OPEN:
            stripped = self._buf.lstrip()
            if not stripped or (len(stripped) < len(THINK_START) and THINK_START.startswith(stripped)):
                return None, None
            self._buf = stripped[len(THINK_START) :] if stripped.startswith(THINK_START) else stripped
            self._state = self._REASONING
        if self._state == self._REASONING:
            idx = self._buf.find(THINK_END)
            if idx >= 0:
                reasoning.append(self._emit_reasoning(self._buf[:idx].rstrip()))
                self._buf = self._buf[idx + len(THINK_END) :]
                self._state = self._AFTER_END
            else:
                # Hold a possible partial tag plus the whitespace before it: if the tag completes, that
                # whitespace is trailing and gets trimmed.
                keep = _partial_tag_len(self._buf, THINK_END)
                ready = self._buf[: len(self._buf) - keep]
                safe = ready.rstrip()
                reasoning.append(self._emit_reasoning(safe))
                self._buf = self._buf[len(safe) :]
        if self._state == self._AFTER_END:
            self._buf = self._buf.lstrip("\n")
            if self._buf:
                self._state = self._CONTENT
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning) or None, "".join(content) or None

    def _emit_reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text

    def finish(self) -> tuple[str | None, str | None]:
        """Release held-back text at the end of generation; returns (reasoning_delta, content_delta)."""
        buf, self._buf = self._buf, ""
        if self._state == self._OPEN:
            # Only whitespace or a prefix of "<think>" arrived: plain (trimmed) reasoning.
            self._state = self._REASONING
            return self._emit_reasoning(buf.strip()) or None, None
        if self._state == self._REASONING:
            # No </think>: everything is reasoning, so held whitespace is trailing unless text follows it.
            return self._emit_reasoning(buf.rstrip()) or None, None
        return None, None
