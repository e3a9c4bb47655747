"""Build the small byte-level BPE tokenizer that goes with the embedded demo model.

The tokenizer copies the real Qwen3.5 tokenizer's structure (NFC normaliser, the same split regex, byte-level
pre-tokenizer and decoder, the 33 added tokens with their special flags, the chat template, eos/pad) but
learns only a few hundred merges from `nibble/assets/demo_corpus.txt`, so its files stay small. Running
`build_demo_tokenizer` twice on the same corpus gives byte-identical files.

Run `python -m nibble.checkpoint.demo_tokenizer [DST_DIR]` to regenerate `nibble/assets/demo_tokenizer/`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
CORPUS_PATH = ASSETS_DIR / "demo_corpus.txt"
CHAT_TEMPLATE_PATH = ASSETS_DIR / "qwen3_5_chat_template.jinja"
DEMO_TOKENIZER_DIR = ASSETS_DIR / "demo_tokenizer"

# The pre-tokenizer split pattern of the Qwen3.5 tokenizer (letters with their combining marks stay
# together, digits are split one by one, punctuation runs keep their trailing newlines).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's added tokens in id order, with their `special` flag. As in Qwen3, the tool-call, tool-response,
# fill-in-the-middle and think markers are added but not special: they survive
# `decode(skip_special_tokens=True)`, which the reasoning and tool-call parsers rely on.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 262144


def _train_base(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE part (all 256 byte symbols plus merges) on the repository corpus."""
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    # Paragraphs as training units keep the result independent of how the file is read in chunks.
    tok.train_from_iterator([p for p in text.split("\n\n") if p], trainer=trainer)
    return tok


def _tokenizer_config(chat_template: str, first_added_id: int) -> dict:
    added_decoder = {
        str(first_added_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": [c for c, special in QWEN_ADDED_TOKENS[1:14] if special],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_tokenizer(dst_dir: str | Path = DEMO_TOKENIZER_DIR, vocab_size: int = 1024) -> dict[str, int]:
    """Build the demo tokenizer into `dst_dir` and return the ids of its added tokens.

    `vocab_size` counts every id, the 33 added tokens included; they take the last 33 ids, as in Qwen3.5
    where they follow the BPE vocabulary. Writes tokenizer.json, tokenizer_config.json (with the Qwen3.5
    chat template), chat_template.jinja, special_tokens_map.json and generation_config.json.
    """
    num_added = len(QWEN_ADDED_TOKENS)
    min_size = 256 + num_added
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} (256 byte symbols + {num_added} added tokens)")
    base_size = vocab_size - num_added
    tok = _train_base(base_size)
    if tok.get_vocab_size() != base_size:
        raise RuntimeError(
            f"the corpus yields only {tok.get_vocab_size()} BPE tokens, fewer than the {base_size} asked for; "
            "lower vocab_size or extend demo_corpus.txt"
        )
    for content, special in QWEN_ADDED_TOKENS:
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    ids = {content: tok.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS}
    if sorted(ids.values()) != list(range(base_size, vocab_size)):
        raise RuntimeError("added tokens did not land on the last ids of the vocabulary")

    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    # Pretty-printed JSON diffs well in review and is still only a few tens of kilobytes.
    _write_json(dst / "tokenizer.json", json.loads(tok.to_str()))
    _write_json(dst / "tokenizer_config.json", _tokenizer_config(chat_template, base_size))
    (dst / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    _write_json(
        dst / "special_tokens_map.json",
        {
            "additional_special_tokens": [c for c, special in QWEN_ADDED_TOKENS[1:14] if special],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )
    # Same fields and order of eos ids as the real Qwen3.5 generation_config.json.
    _write_json(
        dst / "generation_config.json",
        {
            "bos_token_id": ids[PAD_TOKEN],
            "do_sample": True,
            "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
            "pad_token_id": ids[PAD_TOKEN],
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },
    )
    return ids


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build into the directory given as the only argument, or the default assets dir."""
    args = sys.argv[1:] if argv is None else argv
    dst = Path(args[0]) if args else DEMO_TOKENIZER_DIR
    ids = build_demo_tokenizer(dst)
    print(f"wrote {dst} (vocab {max(ids.values()) + 1}; eos {ids[EOS_TOKEN]}, pad {ids[PAD_TOKEN]})")


if __name__ == "__main__":
    main()
