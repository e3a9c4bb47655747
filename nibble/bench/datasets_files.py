"""Datasets read from files for `nibble bench serve`, selected as `vllm bench serve` selects them.

`sharegpt`: a JSON list of conversations, `[{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}, ...]`. A request is a conversation's first turn, generating as many
tokens as its second turn holds (or a fixed count); pairs outside vLLM's length limits are dropped.
`custom`: JSON lines, `{"prompt": ..., "output_tokens": N}` with `output_tokens` optional.

Both are shuffled with the seed (Python's `random`, as vLLM does, so that a seed picks the same ShareGPT
conversations as `vllm bench serve` with that seed) and, when the file holds fewer usable prompts than
asked for, topped up with seeded repeats unless oversampling is off. Problems are `DatasetError`s whose
one-line message names the file and the line, entry or field at fault.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from nibble.bench.datasets import DatasetError, SampleRequest

# vLLM's pruning of ShareGPT pairs (`is_valid_sequence`, inherited from its first serving benchmark): a prompt
# or reply under 4 tokens measures little, and longer pairs did not fit the models those numbers were
# published for. Keeping the limits keeps nibble's ShareGPT numbers comparable with vLLM's.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class ShareGPTFile:
    """The first two turns of every conversation that has at least two, in file order."""

    path: str
    pairs: tuple[tuple[str, str], ...]
    num_entries: int


@dataclass(frozen=True)
class CustomFile:
    """The prompts of a custom JSONL file with their `output_tokens` (None where a line has none)."""

    path: str
    entries: tuple[tuple[str, int | None], ...]


def is_valid_pair(prompt_len: int, output_len: int, fixed_output_len: bool = False) -> bool:
    """vLLM's ShareGPT filter; a fixed output length (`--sharegpt-output-len`) skips the reply's minimum."""
    if prompt_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT_LEN:
        return False
    if not fixed_output_len and output_len < SHAREGPT_MIN_LEN:
        return False
    return prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def _stat(path: str | Path) -> os.stat_result:
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if not p.is_file():
        raise DatasetError(f"dataset path {path} is not a file")
    return p.stat()


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror or e}") from e


def _decode(path: str, data: bytes, line_offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_offset + data[: e.start].count(b"\n") + 1
        raise DatasetError(f"{path}: line {line}: not UTF-8 text") from e


def _turn_text(path: str, index: int, turns: list[Any], turn: int) -> str:
    value = turns[turn].get("value") if isinstance(turns[turn], dict) else None
    if not isinstance(value, str):
        raise DatasetError(f'{path}: entry {index}: conversations[{turn}] has no string "value"')
    return value


# The stat key makes a changed file be read again; the parsed file is kept because the benchmark builds a
# one-prompt dataset for its test request before the full one, and ShareGPT files run to hundreds of MB.
@lru_cache(maxsize=2)
def _parse_sharegpt(path: str, mtime_ns: int, size: int) -> ShareGPTFile:
    text = _decode(path, _read(path))
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(doc, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations, got a {type(doc).__name__}")
    pairs = []
    for index, entry in enumerate(doc):
        if not isinstance(entry, dict):
            raise DatasetError(f"{path}: entry {index}: expected an object, got a {type(entry).__name__}")
        turns = entry.get("conversations")
        if turns is not None and not isinstance(turns, list):
            raise DatasetError(f'{path}: entry {index}: "conversations" must be a list')
        # Entries without a reply are skipped, not refused: vLLM skips them, and real dumps hold some.
        if turns is None or len(turns) < 2:
            continue
        pairs.append((_turn_text(path, index, turns, 0), _turn_text(path, index, turns, 1)))
    return ShareGPTFile(path=path, pairs=tuple(pairs), num_entries=len(doc))


def load_sharegpt(path: str | Path) -> ShareGPTFile:
    """Parse a ShareGPT JSON file (cached while the file is unchanged)."""
    st = _stat(path)
    return _parse_sharegpt(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _parse_custom(path: str, mtime_ns: int, size: int) -> CustomFile:
    entries = []
    for lineno, raw in enumerate(_read(path).split(b"\n"), start=1):
        line = _decode(path, raw, lineno - 1).strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {lineno}: invalid JSON at column {e.colno}: {e.msg}") from e
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}: line {lineno}: expected a JSON object, got a {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise DatasetError(f'{path}: line {lineno}: no string "prompt" field')
        out = obj.get("output_tokens")
        if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 1):
            raise DatasetError(f'{path}: line {lineno}: "output_tokens" must be an integer >= 1, got {out!r}')
        entries.append((prompt, out))
    if not entries:
        raise DatasetError(f"{path}: no prompts (the file has no JSON lines)")
    return CustomFile(path=path, entries=tuple(entries))


def load_custom(path: str | Path) -> CustomFile:
    """Parse a custom JSONL file (cached while the file is unchanged)."""
    st = _stat(path)
    return _parse_custom(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _chat_template(root: str) -> Callable[[str], str]:
    # The engine's tokenizer renders templates exactly as the server does; imported here so that the other
    # datasets do not load Jinja.
    from nibble.engine.chat_template import ChatTemplateError
    from nibble.engine.tokenizer import Tokenizer as ModelTokenizer

    try:
        model_tokenizer = ModelTokenizer.from_pretrained(root)
    except ValueError as e:
        raise DatasetError(str(e)) from e
    if not model_tokenizer.has_chat_template:
        raise DatasetError(
            f"the custom dataset wraps prompts in the model's chat template for the completions API, but {root} "
            "has none (chat_template.jinja or tokenizer_config.json); pass --skip-chat-template to send them "
            "as they are, or use --backend openai-chat"
        )

    def render(prompt: str) -> str:
        try:
            return model_tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        except ChatTemplateError as e:
            raise DatasetError(f"chat template of {root} failed: {e}") from e

    return render


def load_chat_template(tokenizer_path: str | Path) -> Callable[[str], str]:
    """A function that wraps a prompt as one user turn in the chat template found next to `tokenizer_path`
    (a model directory or its tokenizer.json), with the generation prompt, as vLLM's custom dataset does."""
    p = Path(tokenizer_path)
    return _chat_template(str(p if p.is_dir() else p.parent))


def _order(count: int, seed: int, shuffle: bool) -> list[int]:
    order = list(range(count))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order


def _top_up(requests: list[SampleRequest], num_prompts: int, seed: int, oversample: bool) -> list[SampleRequest]:
    """Repeat seeded random picks until there are `num_prompts` (vLLM's oversampling), unless turned off."""
    if oversample and len(requests) < num_prompts:
        rng = random.Random(seed)
        requests = requests + [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests


def _prompt(text: str, ids: Sequence[int], as_token_ids: bool) -> str | list[int]:
    return list(ids) if as_token_ids else text


def sample_sharegpt_requests(
    data: ShareGPTFile,
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    oversample: bool = True,
    shuffle: bool = True,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """Build the `sharegpt` dataset: shuffled pairs, kept while `is_valid_pair` holds, until `num_prompts`.

    Lengths are counted with the tokenizer's defaults (special tokens included, as vLLM's `tokenizer(text)`).
    The output length is the reply's token count unless `output_len` fixes it.
    """
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise DatasetError(f"ShareGPT output length must be >= 1, got {output_len}")
    if not data.pairs:
        raise DatasetError(
            f'{data.path}: no usable conversations: none of its {data.num_entries} entries has a "conversations" '
            'list of two or more turns (expected [{"conversations": [{"from": "human", "value": ...}, '
            '{"from": "gpt", "value": ...}]}, ...])'
        )
    requests: list[SampleRequest] = []
    for i in _order(len(data.pairs), seed, shuffle):
        if len(requests) >= num_prompts:
            break
        prompt, reply = data.pairs[i]
        prompt_ids = tokenizer.encode(prompt).ids
        # The prompt's length alone often settles it; the reply is only tokenized when it can matter.
        if not SHAREGPT_MIN_LEN <= len(prompt_ids) <= SHAREGPT_MAX_PROMPT_LEN:
            continue
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply).ids)
        if not is_valid_pair(len(prompt_ids), out_len, fixed_output_len=output_len is not None):
            continue
        requests.append(SampleRequest(_prompt(prompt, prompt_ids, as_token_ids), len(prompt_ids), out_len))
    if not requests:
        reply_rule = "" if output_len is not None else f", reply >= {SHAREGPT_MIN_LEN} tokens"
        raise DatasetError(
            f"{data.path}: no usable conversations: none of its {len(data.pairs)} prompt/reply pairs passes "
            f"the length filter (prompt {SHAREGPT_MIN_LEN}-{SHAREGPT_MAX_PROMPT_LEN} tokens{reply_rule}, "
            f"prompt + output <= {SHAREGPT_MAX_TOTAL_LEN} tokens)"
        )
    return _top_up(requests, num_prompts, seed, oversample)


def sample_custom_requests(
    data: CustomFile,
    tokenizer: Tokenizer,
    num_prompts: int,
    output_len: int = 256,
    seed: int = 0,
    chat_template: Callable[[str], str] | None = None,
    oversample: bool = True,
    shuffle: bool = True,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """Build the `custom` dataset: shuffled lines, each wrapped by `chat_template` when given.

    A line's `output_tokens` sets its output length, `output_len` the rest's. The prompt length is the
    token count of what is sent (the templated text when there is a template).
    """
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if output_len < 1:
        raise DatasetError(f"custom output length must be >= 1, got {output_len}")
    requests = []
    for i in _order(len(data.entries), seed, shuffle)[:num_prompts]:
        prompt, line_output_len = data.entries[i]
        text = chat_template(prompt) if chat_template is not None else prompt
        ids = tokenizer.encode(text).ids
        requests.append(SampleRequest(_prompt(text, ids, as_token_ids), len(ids), line_output_len or output_len))
    return _top_up(requests, num_prompts, seed, oversample)
