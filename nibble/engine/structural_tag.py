"""vLLM's structural tags: free text in which tagged segments follow a JSON schema.

`{"type": "structural_tag", "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end":
"</function>"}], "triggers": ["<function="]}` lets the model write whatever it likes until it writes a
trigger; from there the segment must be one of the structures that begin with that trigger: its `begin`, a
JSON value of its `schema`, its `end`. Agents use it to keep tool calls inside prose well-formed without
forcing a call. The format is vLLM's (OpenAI's response_format spelling, also `structured_outputs.structural_tag`
as a JSON string); llguidance compiles it (its `StructTag`: lazy lexemes that wake up on the trigger). As in
vLLM's guidance backend, a trigger written like `<tool_call>` stands for the tokenizer's special token of that
name (an error when there is none), not for its characters.
"""

from __future__ import annotations

import json
from typing import Any

# As the JSON mode (structured_output._JSON_OPTIONS): no free whitespace inside a tagged value, so a value
# cannot run on as whitespace until max_tokens.
_STRICT_JSON = {"whitespace_flexible": False}


class StructuralTagError(ValueError):
    """A structural tag spec that cannot be used; the message names the bad part."""


def parse_structural_tag(spec: str | dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """(trigger, begin, schema, end) per structure of a structural tag spec (a dict, or its JSON text).
    Raises StructuralTagError naming the bad part."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
            raise StructuralTagError(f"not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise StructuralTagError(f"must be a JSON object, got {type(spec).__name__}")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError(f"type must be 'structural_tag', got {spec.get('type')!r}")
    if "format" in spec:
        raise StructuralTagError("the 'format' form of structural tags is not supported; give 'structures' and "
                                 "'triggers'")
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise StructuralTagError(f"unknown field(s) {', '.join(unknown)}; a structural tag has structures and "
                                 "triggers")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise StructuralTagError("triggers must be a non-empty list of non-empty strings")
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structures must be a non-empty list of {begin, schema, end} objects")
    out = []
    for i, item in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(item, dict):
            raise StructuralTagError(f"{where} must be an object with begin, schema and end")
        begin, schema, end = item.get("begin"), item.get("schema"), item.get("end")
        if not isinstance(begin, str) or not begin:
            raise StructuralTagError(f"{where}.begin must be a non-empty string")
        if not isinstance(end, str):
            raise StructuralTagError(f"{where}.end must be a string")
        if schema is True:  # the schema every JSON value meets
            schema = {}
        if not isinstance(schema, dict):
            raise StructuralTagError(f"{where}.schema must be a JSON schema object (or true)")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise StructuralTagError(f"{where}.begin {begin!r} does not start with any of the triggers "
                                     f"{', '.join(map(repr, triggers))}")
        out.append((trigger, begin, schema, end))
    return out


def structural_tag_grammar(spec: str | dict[str, Any]) -> str:
    """The Lark grammar (llguidance's dialect) of a structural tag spec; StructuralTagError for a bad spec."""
    import llguidance

    tags = []
    for trigger, begin, schema, end in parse_structural_tag(spec):
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": _STRICT_JSON}
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    try:
        return llguidance.StructTag.to_grammar(tags)
    except (ValueError, TypeError) as exc:
        raise StructuralTagError(str(exc)) from None
