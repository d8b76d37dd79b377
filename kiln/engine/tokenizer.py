"""The serving tokenizer: a `tokenizers.Tokenizer` plus what the engine needs around it.

Built from an HF model directory (tokenizer.json, tokenizer_config.json, generation_config.json and
the newer chat_template.jinja / chat_template.json files) or from GGUF metadata, where llama.cpp
stores a byte-level BPE as token, merge and token-type arrays. The GGUF build follows the
pre-tokenizer the file names (`tokenizer.ggml.pre`), the way llama.cpp and the original
tokenizer.json split text, so the ids match what the model was trained on.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kiln.model.gguf_file import read_gguf_metadata

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer family (llama.cpp's LLAMA_VOCAB_PRE_TYPE_* groups).
_PRE_FAMILIES = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
    "dbrx": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
}


class Tokenizer:
    """Encode/decode plus the model's special tokens, EOS ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        # None: the backend's own post-processor decides what add_special_tokens adds.
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self.bos_token = _known(backend, bos_token, "bos", source)
        self.eos_token = _known(backend, eos_token, "eos", source)
        self.pad_token = _known(backend, pad_token, "pad", source)
        self.unk_token = _known(backend, unk_token, "unk", source)
        named = [t for t in (self.bos_token, self.eos_token, self.pad_token, self.unk_token) if t is not None]
        # Named special tokens must match whole in text, as transformers makes them.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named])
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        head = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys([*head, *extra_eos_token_ids]))
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.special_tokens = frozenset(added[i].content for i in self.special_token_ids)

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """An HF model directory, or a .gguf file."""
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return cls.from_gguf_metadata(read_gguf_metadata(p), source=str(p))
        return cls.from_hf_dir(p)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{root}: no tokenizer.json (Kiln needs a fast-tokenizer file)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json") or {}
        _add_config_tokens(backend, config)
        generation = _read_json(root / "generation_config.json")
        if generation is None:
            # transformers derives the generation config from config.json when the file is absent.
            generation = _read_json(root / "config.json") or {}
        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        return cls(
            backend,
            source=str(root),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            chat_template=_find_chat_template(root, config),
            add_bos_token=bool(add_bos) if add_bos is not None else None,
            add_eos_token=bool(add_eos) if add_eos is not None else None,
            extra_eos_token_ids=_int_list(generation.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, source: str = "<gguf>") -> Tokenizer:
        model = _scalar(meta.get("tokenizer.ggml.model"))
        if model != "gpt2":
            raise ValueError(
                f"{source}: GGUF tokenizer model {model!r} is not supported; Kiln builds byte-level BPE "
                "('gpt2') tokenizers from GGUF. Use the HF model directory instead."
            )
        tokens = [_text(t) for t in _array(meta["tokenizer.ggml.tokens"])]
        token_types = [int(t) for t in _array(meta.get("tokenizer.ggml.token_type", []))]
        merges = [tuple(_text(m).split(" ", 1)) for m in _array(meta.get("tokenizer.ggml.merges", []))]
        pre = _scalar(meta.get("tokenizer.ggml.pre")) or "default"
        family = _PRE_FAMILIES.get(pre)
        if family is None:
            log.warning("%s: unknown GGUF pre-tokenizer %r; splitting text the GPT-2 way", source, pre)
            family = "gpt2"
        alphabet = _byte_alphabet()
        spell = _byte_spelling()
        # Byte-level vocabularies spell every token in the byte alphabet; a few files store raw text.
        vocab = {
            tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
            for i, tok in enumerate(tokens)
        }
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab,
                merges,
                unk_token=None,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=family == "llama3",
            )
        )
        _set_byte_level_pipeline(backend, family)
        specials = [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=False)
            # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: skip it.
            if kind == _CONTROL and set(tok) <= alphabet
        ]
        user = [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == _USER_DEFINED and tok in vocab
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(user)

        def token_at(key: str) -> str | None:
            value = _scalar(meta.get(f"tokenizer.ggml.{key}"))
            return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

        extra_eos = [
            int(_scalar(meta[k]))
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if _scalar(meta.get(k)) is not None
        ]
        template = _scalar(meta.get("tokenizer.chat_template"))
        return cls(
            backend,
            source=source,
            bos_token=token_at("bos_token_id"),
            eos_token=token_at("eos_token_id"),
            pad_token=token_at("padding_token_id"),
            unk_token=token_at("unknown_token_id"),
            chat_template=_text(template) if template is not None else None,
            add_bos_token=bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
            add_eos_token=bool(_scalar(meta.get("tokenizer.ggml.add_eos_token", False))),
            extra_eos_token_ids=extra_eos,
        )

    # ---- the API the engine uses ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens and self._add_bos is None and self._add_eos is None:
            return self.backend.encode(text, add_special_tokens=True).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self._add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # clean_up_tokenization_spaces is deliberately never applied: it is lossy and would break
        # the incremental detokenizer's "pieces add up to the whole" property.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def require_chat_template(self) -> str:
        if not self.chat_template:
            raise ValueError(
                f"The model at {self.source} has no chat template (none in tokenizer_config.json, "
                "chat_template.jinja, chat_template.json or GGUF metadata); Kiln needs one to serve chat."
            )
        return self.chat_template

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


def _known(backend: tokenizers.Tokenizer, token: str | None, role: str, source: str) -> str | None:
    if token is not None and backend.token_to_id(token) is None:
        log.warning("%s: %s token %r is not in the vocabulary; ignoring it", source, role, token)
        return None
    return token


# ---- GGUF -----------------------------------------------------------------------------------------


def _set_byte_level_pipeline(backend: tokenizers.Tokenizer, family: str) -> None:
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    if family in ("llama3", "qwen2"):
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif family == "digits":
        # StarCoder / SmolLM: every digit its own word, then GPT-2's split.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_spelling().values())


def _contents(value: Any) -> Any:
    # Accept gguf ReaderFields and numpy values as well as plain Python ones.
    if hasattr(value, "contents") and callable(value.contents):
        return value.contents()
    return value


def _scalar(value: Any) -> Any:
    value = _contents(value)
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return _scalar(value[0])
    return value


def _array(value: Any) -> list[Any]:
    value = _contents(value)
    return list(value) if value is not None else []


def _text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return str(value)


# ---- HF directories -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _add_config_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Tokens that tokenizer_config.json declares but tokenizer.json does not have as added tokens."""
    known = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    for id_text, spec in sorted(
        (config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])
    ):
        content = _token_content(spec)
        if content is None or content in known:
            continue
        # Only tokens the vocabulary already holds at that id; anything else would shift ids.
        if backend.token_to_id(content) != int(id_text):
            continue
        token = AddedToken(
            content,
            special=bool(spec.get("special", True)),
            normalized=False,
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            single_word=bool(spec.get("single_word", False)),
        )
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    extra = [_token_content(t) for t in config.get("additional_special_tokens") or []]
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in extra
            if t and backend.token_to_id(t) is not None
        ]
    )


def _find_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """transformers' precedence: chat_template.jinja, then chat_template.json, then tokenizer_config."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(root / "chat_template.json")
    if json_file is not None and json_file.get("chat_template"):
        return _pick_template(json_file["chat_template"])
    return _pick_template(config.get("chat_template"))


def _pick_template(value: Any) -> str | None:
    # Older configs store several named templates; the "default" one is the chat template.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) and value else None
