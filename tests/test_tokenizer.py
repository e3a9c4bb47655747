"""Tokenizer, incremental detokenizer and stop-string checker, against `tokenizers` and transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend

from nibble.checkpoint.demo_tokenizer import QWEN_ADDED_TOKENS, build_demo_tokenizer
from nibble.engine.detokenizer import IncrementalDetokenizer, StopChecker
from nibble.engine.generation_config import GenerationConfigError, GenerationDefaults
from nibble.engine.tokenizer import Tokenizer, TokenizerError

DEMO_DIR = Path(__file__).resolve().parent.parent / "nibble" / "assets" / "demo_tokenizer"
SHARED_TOKENIZER = Path("/work/shared/models/qwen3.5/tokenizer/tokenizer.json")
SHARED_GEN_CONFIG = Path("/work/shared/models/qwen3.5/Qwen3.5-397B-A17B/generation_config.json")

TEXTS = [
    "Hello, world! The server streams tokens.",
    "",
    "   leading and trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "你好，世界。人工智能正在改变我们的生活。",
    "日本語のテキスト、こんにちは！ 한국어 문장",
    "Emoji: 👩‍💻 🏳️‍🌈 👍🏽 🇫🇷 😀🚀",
    "Café déjà vu — naïve façade, Straße, Cafe\u0301 (NFD)",
    'def f(x: int) -> str:\n    return f"{x!r}"  # ok\n',
    '{"a": [1, 2.5, -3e4], "b": null, "c": "\\u00e9"}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nyo<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|endoftext|>",
    "replacement char \ufffd in the middle and at the end \ufffd",
    "numbers 1234567890 and 3.14159",
]


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_pretrained(DEMO_DIR)


@pytest.fixture(scope="module")
def demo_backend() -> HFBackend:
    return HFBackend.from_file(str(DEMO_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def demo_hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_DIR))


@pytest.fixture(scope="module")
def shared_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if not SHARED_TOKENIZER.is_file():
        pytest.skip("/work/shared Qwen3.5 tokenizer not present")
    d = tmp_path_factory.mktemp("qwen35_tok")
    (d / "tokenizer.json").symlink_to(SHARED_TOKENIZER)
    if SHARED_GEN_CONFIG.is_file():
        (d / "generation_config.json").symlink_to(SHARED_GEN_CONFIG)
    return Tokenizer.from_pretrained(d)


def _merge_pair(merge: str | list[str]) -> tuple[str, ...]:
    return tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge)


def test_demo_assets_match_builder(tmp_path: Path) -> None:
    ids = build_demo_tokenizer(tmp_path, vocab_size=1024)
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (DEMO_DIR / name).read_bytes(), name
    # tokenizer.json is compared by content: its serialisation details vary across `tokenizers` versions.
    built, committed = (json.loads((d / "tokenizer.json").read_text()) for d in (tmp_path, DEMO_DIR))
    assert built["model"]["vocab"] == committed["model"]["vocab"]
    assert [_merge_pair(m) for m in built["model"]["merges"]] == [_merge_pair(m) for m in committed["model"]["merges"]]
    assert built["added_tokens"] == committed["added_tokens"]
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert built[key] == committed[key], key
    backend = HFBackend.from_file(str(tmp_path / "tokenizer.json"))
    assert backend.get_vocab_size() == 1024
    assert ids == {content: backend.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS}


def test_demo_template_is_the_qwen_template() -> None:
    asset = DEMO_DIR.parent / "qwen3_5_chat_template.jinja"
    assert (DEMO_DIR / "chat_template.jinja").read_text() == asset.read_text()
    assert json.loads((DEMO_DIR / "tokenizer_config.json").read_text())["chat_template"] == asset.read_text()
    shared = Path("/work/shared/models/qwen3.5/chat_template.jinja")
    if shared.is_file():
        assert asset.read_bytes() == shared.read_bytes()


def test_demo_added_tokens_mirror_qwen(shared_tok: Tokenizer, demo_backend: HFBackend) -> None:
    real = sorted(shared_tok.backend.get_added_tokens_decoder().items())
    demo = sorted(demo_backend.get_added_tokens_decoder().items())
    assert [t.content for _, t in demo] == [t.content for _, t in real]
    assert [i - demo[0][0] for i, _ in demo] == [i - real[0][0] for i, _ in real]
    for (_, d), (_, r) in zip(demo, real):
        assert (d.normalized, d.lstrip, d.rstrip, d.single_word) == (r.normalized, r.lstrip, r.rstrip, r.single_word)


def test_demo_metadata(demo: Tokenizer, demo_backend: HFBackend, demo_hf) -> None:
    assert demo.vocab_size == demo_backend.get_vocab_size(with_added_tokens=True) == len(demo_hf)
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert demo.eos_token_id == demo_hf.eos_token_id
    assert demo.eos_token_ids == tuple(dict.fromkeys([demo_hf.eos_token_id, *gen["eos_token_id"]]))
    assert demo.pad_token_id == demo_hf.pad_token_id
    assert demo.bos_token_id is None
    assert demo.all_special_ids == {i for i, t in demo_backend.get_added_tokens_decoder().items() if t.special}
    assert set(demo_hf.all_special_ids) <= demo.all_special_ids
    for token in ("<think>", "</think>", "<tool_call>", "Ġthe", "<|im_end|>"):
        assert demo.token_to_id(token) == demo_backend.token_to_id(token)
        assert demo.id_to_token(demo.token_to_id(token)) == token
    assert demo.token_to_id("no-such-token") is None
    assert demo.id_to_token(10**6) is None


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_vs_references(demo: Tokenizer, demo_backend: HFBackend, demo_hf, text: str) -> None:
    ids = demo.encode(text)
    assert ids == demo_backend.encode(text, add_special_tokens=False).ids
    assert ids == demo_hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert demo.decode(ids, skip_special_tokens=skip) == demo_hf.decode(ids, skip_special_tokens=skip)
        assert demo.decode(ids, skip_special_tokens=skip) == demo_backend.decode(ids, skip_special_tokens=skip)


def test_encode_batch_and_bad_input(demo: Tokenizer) -> None:
    assert demo.encode_batch(TEXTS) == [demo.encode(t) for t in TEXTS]
    with pytest.raises(TypeError):
        demo.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        demo.decode([1, -2])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)


def test_eos_union_from_all_sources(tmp_path: Path, demo_backend: HFBackend) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((DEMO_DIR / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [9, 7]}, "eos_token_id": 8}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (demo_backend.token_to_id("<|im_end|>"), 7, 8, 9)
    assert tok.has_chat_template


def test_shared_qwen_tokenizer_vs_references(shared_tok: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    tok, backend = shared_tok, shared_tok.backend
    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED_TOKENIZER))
    assert tok.vocab_size == backend.get_vocab_size() == len(hf)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == backend.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if SHARED_GEN_CONFIG.is_file():
        gen = json.loads(SHARED_GEN_CONFIG.read_text())
        assert tok.eos_token_ids == tuple(gen["eos_token_id"])


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(detok.step(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


def _check_incremental(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool) -> None:
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip)
    pieces = _stream(detok, ids, rng)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == full == detok.output_text
    if "\ufffd" not in full:
        # Valid text never shows a half-decoded character in any step.
        assert all("\ufffd" not in p for p in pieces)


def test_multibyte_chars_are_split_across_demo_tokens(demo: Tokenizer) -> None:
    # The property the detokenizer tests rely on: single tokens that decode to broken UTF-8.
    ids = demo.encode("".join(TEXTS))
    assert sum("\ufffd" in demo.decode([i]) for i in ids) > 20


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_on_encoded_text(demo: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = demo.encode(text)
        for _ in range(5):
            _check_incremental(demo, ids, rng, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_on_random_ids(demo: Tokenizer, skip: bool) -> None:
    rng = random.Random(1)
    multibyte = [i for i in range(demo.vocab_size) if "\ufffd" in demo.decode([i])]
    specials = sorted(demo.added_tokens)
    for _ in range(200):
        n = rng.randint(1, 40)
        pool = rng.choice([multibyte, list(range(demo.vocab_size)), multibyte + specials])
        _check_incremental(demo, [rng.choice(pool) for _ in range(n)], rng, skip)


def test_incremental_detokenizer_holds_incomplete_char(demo: Tokenizer) -> None:
    ids = demo.encode("世界")
    parts = [demo.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in parts)
    detok = IncrementalDetokenizer(demo, [])
    out = [detok.step([i]) for i in ids]
    assert "".join(out) == "世界"
    assert all("\ufffd" not in o for o in out)
    assert detok.step([]) == "" and detok.flush() == ""


def test_incremental_detokenizer_shared(shared_tok: Tokenizer) -> None:
    tok = shared_tok
    rng = random.Random(2)
    for text in TEXTS:
        _check_incremental(tok, tok.encode(text), rng, True)
    for _ in range(50):
        _check_incremental(tok, [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))], rng, False)


def _stop_reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    # Character-by-character: stop as soon as some stop string has been completed.
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def _run_stop(text: str, stops: list[str], include: bool, cuts: list[int]) -> tuple[str, StopChecker]:
    checker = StopChecker(stops, include_stop_str_in_output=include)
    out, prev = [], 0
    for c in [*cuts, len(text)]:
        emitted, stopped = checker.process(text[prev:c])
        out.append(emitted)
        prev = c
        if stopped:
            break
    out.append(checker.flush())
    return "".join(out), checker


@pytest.mark.parametrize("include", [False, True])
def test_stop_checker_random(include: bool) -> None:
    rng = random.Random(3)
    alphabet = "ab c\n世"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        got, checker = _run_stop(text, stops, include, cuts)
        want, matched = _stop_reference(text, stops, include)
        assert got == want, (text, stops, cuts)
        assert checker.matched == matched and checker.stopped == (matched is not None)


def test_stop_checker_holds_back_possible_prefix() -> None:
    checker = StopChecker(["world", "\n\n"])
    assert checker.process("Hello wor") == ("Hello ", False)
    assert checker.process("m") == ("worm", False)
    assert checker.process("s\n") == ("s", False)
    assert checker.process("\nmore") == ("", True)
    assert checker.matched == "\n\n"
    assert checker.process("anything") == ("", True)
    assert checker.flush() == ""


def test_stop_checker_edge_cases() -> None:
    assert StopChecker([]).process("text") == ("text", False)
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])
    checker = StopChecker(["END"], include_stop_str_in_output=True)
    assert checker.process("abcEN") == ("abc", False)
    assert checker.process("Dxyz") == ("END", True)


def test_generation_defaults(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_pretrained(DEMO_DIR)
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert defaults.temperature == gen["temperature"] and defaults.top_k == gen["top_k"]
    assert defaults.top_p == gen["top_p"] and defaults.eos_token_ids == tuple(gen["eos_token_id"])
    assert defaults.min_p is None and defaults.max_new_tokens is None
    assert defaults.sampling_overrides() == {k: gen[k] for k in ("temperature", "top_p", "top_k")}
    assert GenerationDefaults.from_pretrained(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 5}))
    greedy = GenerationDefaults.from_pretrained(tmp_path)
    assert greedy.eos_token_ids == (5,) and greedy.sampling_overrides() == {"temperature": 0.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "20"}))
    with pytest.raises(GenerationConfigError, match="top_k"):
        GenerationDefaults.from_pretrained(tmp_path)
    if SHARED_GEN_CONFIG.is_file():
        real = json.loads(SHARED_GEN_CONFIG.read_text())
        parsed = GenerationDefaults.from_pretrained(SHARED_GEN_CONFIG.parent)
        assert parsed.eos_token_ids == tuple(real["eos_token_id"]) and parsed.top_p == real["top_p"]
