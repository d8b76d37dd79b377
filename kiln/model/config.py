"""The architecture numbers of a decoder, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Rotary variants the transformer implements; "freq_factors" is llama.cpp's precomputed
# per-frequency divisors (the GGUF `rope_freqs` tensor that encodes llama3 scaling).
SUPPORTED_ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "freq_factors")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this decoder cannot run."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # normalised: always has "rope_type"; None for plain rotary
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # bias on q/k/v projections (qwen2)
    qk_norm: bool = False              # per-head RMSNorm on q and k before rotary (qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"rope scaling type {rope_type!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)} (or none)"
                )

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(arch)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d.get('hidden_act')!r} is not supported; only silu")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise UnsupportedModelError("qwen2 with use_sliding_window=true is not supported")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_theta, rope_scaling = _hf_rope(d)
        # Qwen2's attention always has q/k/v bias (the HF module hard-codes it; configs omit the key).
        bias = bool(d.get("attention_bias", arch == "qwen2"))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_id_list(d.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls, fields: Mapping[str, Any], tensor_names: Iterable[str] | None = None
    ) -> ModelConfig:
        """`fields` is the GGUF key/value metadata as plain Python values.

        `tensor_names` (GGUF names) settles what metadata does not say: a missing `output.weight`
        means a tied head, and `blk.0.attn_q.bias` means q/k/v bias.
        """
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(arch)
        names = set(tensor_names) if tensor_names is not None else None

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        kv_heads = get("attention.head_count_kv") or heads
        vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise UnsupportedModelError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
        eos = _id_list(fields.get("tokenizer.ggml.eos_token_id"))
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            eos += [i for i in _id_list(fields.get(key)) if i not in eos]
        if names is not None:
            tied = "output.weight" not in names
            bias = "blk.0.attn_q.bias" in names
        else:
            tied, bias = False, arch == "qwen2"
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(get),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tied,
            attention_bias=bias,
            qk_norm=arch == "qwen3",
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
        )


def _unsupported_arch(arch: object) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, dict | None]:
    """transformers v5 writes `rope_parameters` (theta inside); v4 wrote `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {})
    return theta, _normalise_scaling(scaling)


def _normalise_scaling(scaling: dict) -> dict | None:
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return None
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return {"rope_type": rope_type, **scaling}


def _gguf_rope_scaling(get: Any) -> dict | None:
    rope_type = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if rope_type in (None, "none") or not factor or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(factor)}
    original = get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return _normalise_scaling(scaling)
