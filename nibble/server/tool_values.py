"""Tool-call parameter values by their JSON schema: which types a parameter's schema names
(`schema_types`), whether its value is raw text or JSON (`is_text_param`), and the conversion of a raw value
back to JSON (`convert_param_value`).

The Qwen3.5 chat template renders string values raw, objects and arrays as JSON, and other scalars as Python
prints them ("True"), so reading a value back needs the schema. Separate from the call parser
(tool_parser.py, which re-exports these names) because the forced-call grammar (tool_grammar.py) follows the
same rule when it generates values: one module decides for both.
"""

from __future__ import annotations

import json
import re
from typing import Any

_INT_RE = re.compile(r"[-+]?\d+")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def _value_type(value: Any) -> str:
    """The JSON type of a Python value decoded from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def listed_values(schema: Any) -> list[Any]:
    """The values a schema's "const" (that one) or "enum" allows; empty when it lists none."""
    if not isinstance(schema, dict):
        return []
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if isinstance(schema.get("enum"), list) else []


def schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema names, in the order they are tried (no repeats): its "type" (a
    name or a list), else its anyOf / oneOf branches' types, else the types of its enum / const values with
    "string" last, else "object" for "properties" and "array" for "items". Names that are not JSON types
    are left out; empty when the schema names no type."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if declared is not None:
        names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
        return list(dict.fromkeys(t for t in names if t in _JSON_TYPES))
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for sub in branches if isinstance(branches, list) else []:
            types += [t for t in schema_types(sub) if t not in types]
    if not types:
        # Strings last: a string member is compared as text, so any other member makes the value JSON.
        types = sorted(dict.fromkeys(_value_type(v) for v in listed_values(schema)), key=lambda t: t == "string")
    if not types and "properties" in schema:
        types = ["object"]
    if not types and "items" in schema:
        types = ["array"]
    return types


def _text_types(types: list[str]) -> bool:
    named = [t for t in types if t != "null"]
    return not types or (bool(named) and named[0] == "string")


def is_text_param(schema: Any) -> bool:
    """Whether a tool-call parameter with this JSON schema takes its value as raw text (True) or as JSON
    (False): the one rule that `convert_param_value` (reading calls) and tool_grammar.py (forcing them) both
    follow, so that a forced value is generated the way it is read back.

    Text when the schema names no JSON type (`schema_types` is empty) or the first type other than "null"
    it names is "string"; JSON otherwise. Why: the chat template renders strings raw and other values as
    JSON, and vLLM's qwen3_coder parser reads a value whose schema has no type as a string. A union of
    "string" with other types (a "type" list, anyOf / oneOf) could be either: it follows its declared order,
    the order the tool parser has always tried the types in, so the schema's author chooses and values that
    parsed before parse the same. "null" never decides: a nullable string is text, where `null` / `None`
    reads as null. An enum or const is text only when its non-null members are all strings, so that any
    other member keeps its type.
    """
    return _text_types(schema_types(schema))


def convert_param_value(value: str, schema: Any) -> Any:
    """Convert a raw parameter value by its JSON schema; a value that does not convert stays a string.

    A text value (`is_text_param`) is returned as is, or None when the schema admits null and the value is
    `null` / `None`. A JSON value is converted by the schema's types in order (`schema_types`), each also
    taking what the template prints for it ("True", "None"); "string" takes a JSON string literal.
    """
    s = value.strip()
    types = schema_types(schema)
    if _text_types(types):
        return None if "null" in types and s.lower() in ("null", "none") else value
    for kind in types:
        try:
            if kind == "integer":
                if _INT_RE.fullmatch(s):
                    return int(s)
                number = json.loads(s, parse_constant=_reject_constant)
                if isinstance(number, float) and number.is_integer():
                    return int(number)
            elif kind == "number":
                number = json.loads(s, parse_constant=_reject_constant)
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    return number
            elif kind == "boolean":
                if s.lower() in ("true", "false"):
                    return s.lower() == "true"
            elif kind == "null":
                if s.lower() in ("null", "none"):
                    return None
            else:
                parsed = json.loads(s, parse_constant=_reject_constant)
                if isinstance(parsed, {"string": str, "object": dict, "array": list}[kind]):
                    return parsed
        except (ValueError, RecursionError):
            continue
    return value
