"""Chat-template rendering that matches Hugging Face `apply_chat_template(..., tokenize=False)`.

Templates come from model repositories, so they are untrusted code: they run in Jinja's immutable sandbox,
with the same environment settings, filters and globals that transformers provides (so a template renders
here exactly as it does there). Messages arriving over HTTP are checked and normalised first by
`validate_messages`; every problem, in the messages or raised by the template, becomes a `ChatTemplateError`
whose message can be returned to the client as an HTTP 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older names clients use for an assistant message's reasoning; templates read `reasoning_content`.
_REASONING_ALIASES = ("reasoning", "thinking")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: bad message structure, or the template itself raised."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ', which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja namespace that refuses underscore-prefixed attributes, closing a route to Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by training templates) and renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks and loopcontrols are what transformers sets; templates are written for them.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def load_chat_template(value: str) -> str:
    """The template a `--chat-template` value names, as vLLM reads the flag: the contents of the file at that
    path, else the value itself when it is Jinja (holds `{{` or `{%`). Raises ChatTemplateError otherwise."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {value}: cannot read it ({exc})") from exc
    except ValueError:  # not a usable path (e.g. a template with NUL bytes)
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ChatTemplateError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


class ChatTemplate:
    """A compiled chat template. `render` takes already-validated messages (see `validate_messages`)."""

    def __init__(self, source: str) -> None:
        """Compile `source`; a syntax error raises `ChatTemplateError` naming the line."""
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render the conversation; `variables` become template variables (special tokens, enable_thinking...).

        Raises `ChatTemplateError` with the template's own message when it calls `raise_exception`, and with
        a description of the failure for any other error while rendering.
        """
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() messages are written for users ("No user query found in messages."); a role
            # complaint gets the roles that were sent, since templates do not say which one they rejected.
            message = str(exc) or type(exc).__name__
            if "role" in message.lower():
                roles = ", ".join(f"messages[{i}]: '{m.get('role')}'" for i, m in enumerate(messages))
                message = f"{message} (roles sent: {roles})"
            raise ChatTemplateError(message) from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def _plain(value: Any, where: str) -> Any:
    """Deep-copy `value` into plain JSON types, so the sandbox only ever sees dicts, lists and scalars."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ChatTemplateError(f"{where}: keys must be strings, got {key!r}")
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ChatTemplateError(f"{where}: unsupported value of type {type(value).__name__}")


def _join_text_parts(content: list[Any], where: str) -> str:
    texts = []
    for i, part in enumerate(content):
        loc = f"{where}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{loc}: content parts must be objects like {{'type': 'text', 'text': ...}}")
        kind = part.get("type", "text")
        if kind != "text":
            raise ChatTemplateError(f"{loc}: content part type {kind!r} is not supported; nibble serves text only "
                                    "so far")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{loc}.text: must be a string")
        texts.append(text)
    # Qwen3.5's template concatenates text parts with no separator; joining the same way keeps the prompt
    # identical to rendering the list itself.
    return "".join(texts)


def _validate_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"{where}: must be a list")
    out = []
    for i, call in enumerate(tool_calls):
        loc = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise ChatTemplateError(f"{loc}: must be an object")
        call = dict(call)
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatTemplateError(f"{loc}.function: must be an object with 'name' and 'arguments'")
        function = dict(function)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatTemplateError(f"{loc}.function.name: must be a non-empty string")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            # OpenAI clients send arguments as a JSON string; templates iterate over them as a mapping.
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
                msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise ChatTemplateError(f"{loc}.function.arguments: not valid JSON ({msg})") from exc
        if not isinstance(arguments, dict):
            raise ChatTemplateError(f"{loc}.function.arguments: must be a JSON object")
        function["arguments"] = arguments
        call["function"] = function
        out.append(call)
    return out


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages and return normalised copies ready for a template.

    Each message needs a string `role`; `content` may be a string, a list of text parts (joined into one
    string), or null/absent for assistant messages. Keys whose value is null are dropped (templates test
    for presence), `developer` becomes `system`, `reasoning`/`thinking` are copied to `reasoning_content`,
    and tool-call arguments given as JSON strings are parsed into objects. Raises `ChatTemplateError`.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages: must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages: must contain at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where}: must be an object with 'role' and 'content'")
        msg = {key: value for key, value in _plain(message, where).items() if value is not None}
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role: must be a non-empty string")
        if role == "developer":
            msg["role"] = role = "system"
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise ChatTemplateError(f"{where}.content: required for role '{role}'")
        elif isinstance(content, list):
            msg["content"] = _join_text_parts(content, f"{where}.content")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"{where}.content: must be a string or a list of text parts")
        if "reasoning_content" not in msg:
            for alias in _REASONING_ALIASES:
                if isinstance(msg.get(alias), str):
                    msg["reasoning_content"] = msg[alias]
                    break
        if "reasoning_content" in msg and not isinstance(msg["reasoning_content"], str):
            raise ChatTemplateError(f"{where}.reasoning_content: must be a string")
        if "tool_calls" in msg:
            if role != "assistant":
                raise ChatTemplateError(f"{where}.tool_calls: only assistant messages can carry tool calls")
            msg["tool_calls"] = _validate_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check an OpenAI `tools` list (`[{"type": "function", "function": {"name": ...}}]`); None stays None.

    The tool objects are returned as plain copies with their keys in the client's order, because templates
    serialise them with `tojson` and the order is part of the prompt.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError("tools: must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"{where}: must be an object")
        tool = _plain(tool, where)
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"{where}.type: only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatTemplateError(f"{where}.function: must be an object with a 'name'")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatTemplateError(f"{where}.function.name: must be a non-empty string")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatTemplateError(f"{where}.function.parameters: must be a JSON schema object")
        out.append(tool)
    return out
