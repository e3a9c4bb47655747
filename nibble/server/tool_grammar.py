"""`tool_choice` "required" or a named function: a Lark grammar (llguidance dialect) that admits only tool
calls in the Qwen3-Coder XML format the Qwen3.5 chat template teaches (shown in tool_parser.py, whose tags it
uses), so the structured-output machinery forces the model to call a tool.

The function is one of the offered ones (or the named one); the parameters follow the order of the
function's JSON schema `properties`, the required ones present, the others optional. A string-typed (or
untyped) value is free text up to the closing tag, as the template renders strings (one of its values for a
string enum); any other value is JSON following its schema, which the tool parser converts back. With
parallel calls several calls may follow each other, one per line, as the template renders them.
"""

from __future__ import annotations

import json
from typing import Any

from nibble.server.tool_parser import (
    FUNCTION_END,
    FUNCTION_PREFIX,
    PARAMETER_END,
    PARAMETER_PREFIX,
    TOOL_CALL_END,
    TOOL_CALL_START,
)


def _rx(tag: str) -> str:
    return tag.replace("/", "\\/")  # '/' delimits llguidance's regex literals


# A text value and its closing tag: anything up to the first "\n</parameter>\n" (matched lazily) in which no
# tag the tool parser would take as the value's end (`</parameter>`, `<parameter=`, `</function>`) comes
# earlier.
TEXT_VALUE = (f"TEXT_VALUE: /(?s:.*)\\n{_rx(PARAMETER_END)}\\n/ & "
              f"~/(?s:.*)({'|'.join(_rx(t) for t in (PARAMETER_END, PARAMETER_PREFIX, FUNCTION_END))})"
              f"(?s:.*){_rx(PARAMETER_END)}\\n/")


def _lit(text: str) -> str:
    """A Lark string literal for `text` (JSON escapes, which llguidance's literals accept)."""
    return json.dumps(text, ensure_ascii=False)


_VALUE_CLOSE = _lit(f"\n{PARAMETER_END}\n")


def _is_text(schema: Any) -> bool:
    if not isinstance(schema, dict) or "type" not in schema:
        return True
    kind = schema["type"]
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _function_rules(i: int, function: dict[str, Any]) -> list[str]:
    params = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or [])
    rules: list[str] = []
    body: list[str] = [_lit(f"{FUNCTION_PREFIX}{function['name']}>\n")]
    for j, (name, schema) in enumerate(props.items()):
        head = _lit(f"{PARAMETER_PREFIX}{name}>\n")
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            choices = " | ".join(_lit(v) for v in enum)
            rules.append(f"p{i}_{j}: {head} ({choices}) {_VALUE_CLOSE}")
        elif _is_text(schema):
            rules.append(f"v{i}_{j}[lazy]: TEXT_VALUE")
            rules.append(f"p{i}_{j}: {head} v{i}_{j}")
        else:
            rules.append(f"p{i}_{j}: {head} %json {json.dumps(schema)} {_VALUE_CLOSE}")
        body.append(f"p{i}_{j}" + ("" if name in required else "?"))
    rules.insert(0, f"f{i}: " + " ".join(body))
    return rules


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True,
                      tag_ids: dict[str, int] | None = None) -> str:
    """The grammar of the calls `tool_choice` demands. tools: the request's tools (already validated);
    name: the one function that must be called (a named tool_choice), else any of them; parallel: whether
    more than one call may follow (never with a named function, as vLLM); tag_ids: token ids of the
    `<tool_call>` / `</tool_call>` tags where the tokenizer has them as single (special) tokens, which
    text literals cannot match (Qwen3.5's tokenizer does)."""
    ids = tag_ids or {}

    def tag(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else _lit(text)

    functions = [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
    if not functions:
        raise ValueError(f"no function named {name!r} among the tools" if name else "no tools to call")
    lines = ['%llguidance {}']
    many = parallel and name is None
    lines.append("start: call" + (' ("\\n" call)*' if many else ""))
    names = " | ".join(f"f{i}" for i in range(len(functions)))
    close = _lit(f"{FUNCTION_END}\n")
    lines.append(f'call: {tag(TOOL_CALL_START)} "\\n" ({names}) {close} {tag(TOOL_CALL_END)}')
    for i, function in enumerate(functions):
        lines.extend(_function_rules(i, function))
    lines.append(TEXT_VALUE)
    return "\n".join(lines) + "\n"
