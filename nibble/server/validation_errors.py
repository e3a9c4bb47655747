"""`format_validation_error`: one readable message for a request that failed pydantic validation, for the
HTTP 400 `ErrorResponse`. Separate from the request models (protocol.py, which re-exports it) because it
reads pydantic's error list rather than any one model: `parse_model` (serving_base.py) applies it to whichever
request model failed.
"""

from __future__ import annotations

from pydantic import ValidationError

# Union-typed fields produce one pydantic error per union member (its name second in the location); these say
# what the field accepts. Another model's field of the same name and another type keeps pydantic's message.
_FIELD_EXPECTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "tool_choice": "'auto', 'none', 'required' or a named function",
}


def _loc_text(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def format_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """One readable message for a request that failed validation, and the name of the first bad field.

    Example: ("temperature: Input should be greater than or equal to 0 (got -1)", "temperature").
    """
    messages: list[str] = []
    first_param: str | None = None
    seen_fields: set[str] = set()
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        field = str(loc[0]) if loc else ""
        if field in seen_fields:
            continue
        seen_fields.add(field)
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err.get("type") == "missing":
            text = f"{_loc_text(loc)}: field required"
        elif field in _FIELD_EXPECTS and err.get("type") not in ("value_error",) and len(loc) > 1 \
                and isinstance(loc[1], str):
            text = f"{field}: must be {_FIELD_EXPECTS[field]}"
        else:
            # Union members add type names to the location (e.g. 'str', 'list[int]'); they only confuse.
            path = _loc_text(tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in ("str", "int"))))
            given = err.get("input")
            # Range and type errors read better with the offending value; our own messages already say it.
            show = err.get("type") != "value_error" and isinstance(given, (int, float, str)) and len(repr(given)) <= 40
            got = f" (got {given!r})" if show else ""
            text = f"{path}: {msg}{got}" if path else msg
        messages.append(text)
        if first_param is None and field:
            first_param = _loc_text(loc[:1]) if field in _FIELD_EXPECTS else _loc_text(loc)
    return "; ".join(messages) or "invalid request", first_param
