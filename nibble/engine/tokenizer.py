"""Tokenizer of a Hugging Face model directory, on the `tokenizers` library alone (no transformers).

Reads tokenizer.json (the fast tokenizer: vocabulary, merges, added tokens, normaliser, decoder) and,
when present, tokenizer_config.json (eos/pad/bos, added tokens, chat template), chat_template.jinja,
generation_config.json and config.json (for the set of end-of-sequence ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from nibble.engine.chat_template import ChatTemplate, ChatTemplateError, validate_messages, validate_tools

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A model directory whose tokenizer files are missing or malformed; the message names the file."""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as plain strings or as serialised AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    Build with `Tokenizer.from_pretrained(model_dir)`. `chat_template` may be None (base models); then
    `apply_chat_template` raises `ChatTemplateError`.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; `special_tokens` maps names like 'eos_token' to token strings."""
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        templates = {"default": chat_template} if isinstance(chat_template, str) else dict(chat_template or {})
        self._templates = {name: ChatTemplate(src) for name, src in templates.items()}
        self._added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in self._added.items() if tok.special)
        eos_name = self.special_tokens.get("eos_token")
        own_eos = None if eos_name is None else backend.token_to_id(eos_name)
        # The tokenizer's own eos comes first; duplicates across the three sources are dropped.
        eos = ([own_eos] if own_eos is not None else []) + list(eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a model directory holding at least tokenizer.json; `chat_template` (Jinja source) replaces
        the directory's template."""
        root = Path(model_dir)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json (nibble needs the fast-tokenizer file)")
        try:
            backend = _Backend.from_file(str(tok_path))
        except Exception as exc:
            raise TokenizerError(f"{tok_path}: cannot load ({exc})") from exc
        config = _read_json(root / "tokenizer_config.json") or {}
        cls._add_missing_tokens(backend, config, root / "tokenizer_config.json")

        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                special[key] = content

        # A chat_template.jinja file takes precedence over the copy inside tokenizer_config.json, as in
        # transformers, so editing that file is enough to change the template.
        template_file = root / "chat_template.jinja"
        templates: str | dict[str, str] | None
        if chat_template is not None:
            templates = chat_template
        elif template_file.is_file():
            templates = template_file.read_text(encoding="utf-8")
        else:
            templates = cls._config_templates(config.get("chat_template"), root / "tokenizer_config.json")

        eos_ids = _as_id_list((_read_json(root / "generation_config.json") or {}).get("eos_token_id"))
        model_config = _read_json(root / "config.json") or {}
        eos_ids += _as_id_list(model_config.get("eos_token_id"))
        text_config = model_config.get("text_config")
        if isinstance(text_config, dict):
            eos_ids += _as_id_list(text_config.get("eos_token_id"))
        return cls(backend, chat_template=templates, special_tokens=special, eos_token_ids=eos_ids)

    @staticmethod
    def _add_missing_tokens(backend: _Backend, config: dict[str, Any], path: Path) -> None:
        # Some exports list added tokens only in tokenizer_config.json; the backend must know them to
        # encode them as single ids.
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerError(f"{path}: added_tokens_decoder must be an object")
        for entry in decoder.values():
            content = _token_content(entry)
            if content is None or backend.token_to_id(content) is not None:
                continue
            token = AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", False)),
                special=bool(entry.get("special", True)),
            )
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])

    @staticmethod
    def _config_templates(value: Any, path: Path) -> str | dict[str, str] | None:
        if value is None or isinstance(value, str):
            return value
        # Older format: a list of named templates ("default", "tool_use", ...).
        if isinstance(value, list):
            named = {}
            for item in value:
                ok = isinstance(item, dict) and isinstance(item.get("name"), str)
                if not ok or not isinstance(item.get("template"), str):
                    raise TokenizerError(f"{path}: chat_template list entries need 'name' and 'template' strings")
                named[item["name"]] = item["template"]
            return named
        raise TokenizerError(f"{path}: chat_template must be a string or a list of named templates")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be padded beyond this)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: tokenizer eos, then generation_config and config.json eos ids."""
        return self._eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos id (first of `eos_token_ids`), or None."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of the pad token named in tokenizer_config.json, or None."""
        content = self.special_tokens.get("pad_token")
        return None if content is None else self._backend.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the bos token named in tokenizer_config.json, or None (Qwen has none)."""
        content = self.special_tokens.get("bos_token")
        return None if content is None else self._backend.token_to_id(content)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of added tokens flagged special (dropped by `decode(skip_special_tokens=True)`)."""
        return self._special_ids

    @property
    def added_tokens(self) -> dict[int, str]:
        """Added tokens by id (special or not)."""
        return {i: tok.content for i, tok in self._added.items()}

    @property
    def has_chat_template(self) -> bool:
        """Whether the model directory supplied a chat template."""
        return bool(self._templates)

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; added-token strings in it (e.g. "<|im_end|>") become their single ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for several texts at once (parallel inside the tokenizers library)."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Incomplete UTF-8 at the end shows as U+FFFD; ids past the vocabulary are ignored."""
        ids = list(ids)
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"token ids must be non-negative integers, got {i!r}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (in its byte-level spelling, e.g. 'Ġthe') or added token, else None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of `token_id` (byte-level spelling), or None when out of range."""
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a chat prompt string, like transformers' `apply_chat_template(..., tokenize=False)`.

        The template sees `messages`, `tools`, `add_generation_prompt`, the special-token strings
        (`eos_token`, `pad_token`, ...), `enable_thinking` when not None, and `template_kwargs` (clients'
        `chat_template_kwargs`, which may override the special-token strings, as in transformers).
        `continue_final_message`: the prompt ends inside the final (assistant) message, right after its content,
        so that generation continues it (an answer prefilled by the client), cut as transformers cuts it. Raises
        `ChatTemplateError` for invalid messages or when the template rejects the conversation.
        """
        if not self._templates:
            raise ChatTemplateError("this model has no chat template; use the completions API with a raw prompt")
        checked_tools = validate_tools(tools)
        # Named templates: transformers picks 'tool_use' when tools are given and that template exists.
        name = "tool_use" if checked_tools and "tool_use" in self._templates else "default"
        template = self._templates.get(name) or next(iter(self._templates.values()))
        variables: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        checked = validate_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: "
                                        "set add_generation_prompt to false to continue the final message")
            if checked[-1]["role"] != "assistant":
                raise ChatTemplateError(f"messages[{len(checked) - 1}].role: continue_final_message continues an "
                                        f"assistant message, got '{checked[-1]['role']}'")
        rendered = template.render(checked, tools=checked_tools, add_generation_prompt=add_generation_prompt,
                                   **variables)
        if not continue_final_message:
            return rendered
        # Where the final content starts: the same conversation with a marker in its place. Searching the whole
        # prompt (transformers' way) cuts inside an earlier turn that happens to hold the same text.
        marked = [*checked[:-1], {**checked[-1], "content": _FINAL_MARKER}]
        probe = template.render(marked, tools=checked_tools, add_generation_prompt=False, **variables)
        start = probe.find(_FINAL_MARKER)
        return _cut_after_final_message(rendered, checked[-1], start if rendered[:start] == probe[:start] else -1)


# Stands for the final message's content while finding where that content starts (private-use characters, which
# no template trims or escapes).
_FINAL_MARKER = "\ue000nibble-final-message\ue001"


def _cut_after_final_message(rendered: str, final: dict[str, Any], start: int = -1) -> str:
    """`rendered` up to the end of the final message's content (templates trim it; then up to its trimmed form),
    dropping the end-of-turn the template wrote after it. `start`: where that content begins in `rendered`, when
    known; else its last occurrence is taken, as transformers does."""
    content = final.get("content") or ""
    for text in (content, content.strip()):
        if not text:
            continue
        if start >= 0:
            if rendered.startswith(text, start):
                return rendered[: start + len(text)]
            continue
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    if start >= 0:
        return _cut_after_final_message(rendered, final)
    raise ChatTemplateError(f"continue_final_message: the final message's content {content[:40]!r} does not appear "
                            "in the rendered prompt (an empty message has nothing to continue)")
