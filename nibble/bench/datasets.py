"""Prompt datasets for `nibble bench serve`.

Only the `random` dataset exists: prompts made of random token ids, with lengths drawn around a target so
that a run measures the server at a known input/output shape (the convention of `vllm bench serve` and
`sglang.bench_serving`). A text prompt is re-encoded until it is exactly the requested number of tokens,
so that the server processes the input length the report claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# Rounds of decode -> re-encode -> trim/extend before starting over from fresh random ids; byte-level BPE
# usually settles in two or three.
_MAX_ADJUST_ROUNDS = 16
_MAX_RESTARTS = 8


class DatasetError(ValueError):
    """A dataset cannot be built from the given tokenizer or parameters."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt as text or token ids, its token count and the tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizers` tokenizer from a tokenizer.json file or a directory that holds one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DatasetError(f"no tokenizer.json at {path}")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception on malformed files
        raise DatasetError(f"cannot load tokenizer {p}: {e}") from e


def sample_lengths(rng: np.random.Generator, num: int, target_len: int, range_ratio: float) -> np.ndarray:
    """Draw `num` lengths uniformly in [target*(1-r), target*(1+r)], never below 1 (r = 0: all = target)."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(np.floor(target_len * (1.0 - range_ratio))))
    high = max(low, int(np.ceil(target_len * (1.0 + range_ratio))))
    return rng.integers(low, high + 1, size=num)


def _candidate_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids safe to sample: the base vocabulary without special/added tokens, which would change the prompt's
    meaning (chat markers, EOS) and often do not round-trip through decode."""
    added = set(tokenizer.get_added_tokens_decoder())
    # The unknown token decodes to a marker such as "[UNK]" that re-encodes as several tokens, so a
    # prompt holding it never settles at the target length.
    unk_token = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk_token) if isinstance(unk_token, str) else None
    if unk_id is not None:
        added.add(unk_id)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = np.array([i for i in range(vocab_size) if i not in added], dtype=np.int64)
    if ids.size == 0:
        raise DatasetError("tokenizer has no ordinary tokens to sample from")
    return ids


def _exact_text_prompt(
    tokenizer: Tokenizer, rng: np.random.Generator, candidates: np.ndarray, target_len: int
) -> tuple[str, list[int]]:
    """Random text that encodes to exactly `target_len` tokens, and those tokens.

    Decoding random ids and re-encoding the text rarely gives the same ids back (merges across token
    boundaries, partial UTF-8), so the re-encoded ids are trimmed or extended and the loop repeats until
    the round trip is stable at the target length.
    """
    for _ in range(_MAX_RESTARTS):
        ids = rng.choice(candidates, size=target_len).tolist()
        for _ in range(_MAX_ADJUST_ROUNDS):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            encoded = tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) == target_len:
                return text, encoded
            if len(encoded) > target_len:
                ids = encoded[:target_len]
            else:
                ids = encoded + rng.choice(candidates, size=target_len - len(encoded)).tolist()
    raise DatasetError(f"could not build a text prompt of exactly {target_len} tokens with this tokenizer")


def sample_random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """Build the `random` dataset.

    Input and output lengths are drawn with `sample_lengths`. With `as_token_ids` the prompt is the list of
    random ids itself (for servers whose completions API takes `prompt: list[int]`), otherwise text that
    the tokenizer encodes (without special tokens) to exactly the drawn length.
    """
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise DatasetError(f"input and output lengths must be >= 1, got {input_len} and {output_len}")
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    candidates = _candidate_ids(tokenizer)
    requests = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        if as_token_ids:
            prompt: str | list[int] = rng.choice(candidates, size=in_len).tolist()
        else:
            prompt, _ = _exact_text_prompt(tokenizer, rng, candidates, in_len)
        requests.append(SampleRequest(prompt=prompt, prompt_len=in_len, output_len=out_len))
    return requests
