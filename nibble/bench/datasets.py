"""Prompt datasets for `nibble bench serve`.

The synthetic datasets live here; the file-based ones (`sharegpt`, `custom`) in `nibble.bench.datasets_files`.

`random`: prompts made of random token ids, with lengths drawn around a target so that a run measures the
server at a known input/output shape (the convention of `vllm bench serve` and `sglang.bench_serving`),
optionally after a prefix shared by every prompt. `prefix_repetition`: a few random prefixes, each shared
by several prompts that differ in a random suffix, to measure a server's prefix cache. A text prompt is
re-encoded until it is exactly the requested number of tokens, so that the server processes the input
length the report claims, and a shared prefix encodes to the same ids in every prompt, so that the server
can reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    candidates: np.ndarray,
    target_len: int,
    prefix_ids: Sequence[int] = (),
) -> tuple[str, list[int]]:
    """Random text that encodes to `prefix_ids` followed by exactly `target_len` more tokens, and its ids.

    Decoding random ids and re-encoding the text rarely gives the same ids back (merges across token
    boundaries, partial UTF-8), so the re-encoded ids are trimmed or extended and the loop repeats until
    the round trip is stable at the target length. The prefix is decoded together with the rest (decoders
    such as WordLevel's put separators between tokens), and a draw whose text changes the prefix's ids, by
    merging across the boundary, is thrown away: a server's prefix cache matches ids, not text.
    """
    prefix = list(prefix_ids)
    for _ in range(_MAX_RESTARTS):
        ids = rng.choice(candidates, size=target_len).tolist()
        for _ in range(_MAX_ADJUST_ROUNDS):
            text = tokenizer.decode(prefix + ids, skip_special_tokens=False)
            encoded = tokenizer.encode(text, add_special_tokens=False).ids
            if encoded[: len(prefix)] != prefix:
                break
            rest = encoded[len(prefix) :]
            if len(rest) == target_len:
                return text, encoded
            if len(rest) > target_len:
                ids = rest[:target_len]
            else:
                ids = rest + rng.choice(candidates, size=target_len - len(rest)).tolist()
    what = f"{target_len} tokens after a {len(prefix)}-token prefix" if prefix else f"{target_len} tokens"
    raise DatasetError(f"could not build a text prompt of exactly {what} with this tokenizer")


def _random_prompt(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    candidates: np.ndarray,
    length: int,
    prefix_ids: Sequence[int],
    as_token_ids: bool,
) -> str | list[int]:
    """`prefix_ids` then `length` random tokens, as ids or as text that encodes to exactly those counts."""
    if as_token_ids:
        return list(prefix_ids) + rng.choice(candidates, size=length).tolist()
    return _exact_text_prompt(tokenizer, rng, candidates, length, prefix_ids)[0]


def _random_prefix(
    tokenizer: Tokenizer, rng: np.random.Generator, candidates: np.ndarray, length: int, as_token_ids: bool
) -> list[int]:
    """Ids of a random prefix; as text prompts go, ids that survive a decode/encode round trip."""
    if as_token_ids:
        return rng.choice(candidates, size=length).tolist()
    return _exact_text_prompt(tokenizer, rng, candidates, length)[1]


def sample_random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_token_ids: bool = False,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Build the `random` dataset.

    Input and output lengths are drawn with `sample_lengths`. With `as_token_ids` the prompt is the list of
    random ids itself (for servers whose completions API takes `prompt: list[int]`), otherwise text that
    the tokenizer encodes (without special tokens) to exactly the drawn length. `prefix_len` random tokens,
    the same in every prompt, come first and add to the drawn length (vLLM's `--random-prefix-len`).
    """
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise DatasetError(f"input and output lengths must be >= 1, got {input_len} and {output_len}")
    if prefix_len < 0:
        raise DatasetError(f"prefix length must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    candidates = _candidate_ids(tokenizer)
    # Drawn only when asked for, so that a seed gives the same prompts as before prefixes existed.
    prefix = _random_prefix(tokenizer, rng, candidates, prefix_len, as_token_ids) if prefix_len else []
    requests = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        prompt = _random_prompt(tokenizer, rng, candidates, in_len, prefix, as_token_ids)
        requests.append(SampleRequest(prompt=prompt, prompt_len=prefix_len + in_len, output_len=out_len))
    return requests


def sample_prefix_repetition_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    as_token_ids: bool = False,
    shuffle: bool = True,
) -> list[SampleRequest]:
    """Build the `prefix_repetition` dataset: `num_prefixes` random prefixes of `prefix_len` tokens, each
    followed in its prompts by a fresh random suffix of `suffix_len` tokens; every request generates
    `output_len` tokens.

    The prompts are spread over the prefixes as evenly as possible, so exactly `num_prompts` come back
    (vLLM gives each prefix num_prompts // num_prefixes and drops the remainder); with fewer prompts than
    prefixes only the first prefixes are used. Shuffled, so that requests sharing a prefix interleave as
    they would in real traffic, and a pass that takes the first N still sees several prefixes.
    """
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if prefix_len < 1 or suffix_len < 0 or output_len < 1:
        raise DatasetError(
            f"prefix and output lengths must be >= 1 and the suffix length >= 0, got prefix {prefix_len}, "
            f"suffix {suffix_len}, output {output_len}"
        )
    if num_prefixes < 1:
        raise DatasetError(f"number of prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    candidates = _candidate_ids(tokenizer)
    base, extra = divmod(num_prompts, num_prefixes)
    requests = []
    for i in range(num_prefixes):
        count = base + (1 if i < extra else 0)
        if count == 0:
            break
        prefix = _random_prefix(tokenizer, rng, candidates, prefix_len, as_token_ids)
        for _ in range(count):
            prompt = _random_prompt(tokenizer, rng, candidates, suffix_len, prefix, as_token_ids)
            requests.append(SampleRequest(prompt=prompt, prompt_len=prefix_len + suffix_len, output_len=output_len))
    if shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests)).tolist()]
    return requests
