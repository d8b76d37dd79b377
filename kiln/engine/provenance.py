"""Content identities of what serves a request, and the rollout-provenance record (semantics.md §6).

Every digest is "sha256:" + lowercase hex. The recipes (tests recompute each one):
- base model: SHA-256 of canonical JSON `{"format", "files": [{"name", "sha256", "size"}]}` over the
  weight files (the .gguf file; or every *.safetensors of an HF directory, sorted by name). It is
  computed once and cached beside the weights, or under the data dir when that place is read-only;
  the cache is trusted only while every file's size and mtime still match.
- tokenizer vocabulary: canonical JSON of the tokenizer's `model` section (vocab, merges, type) plus
  its added tokens; tokenizer configuration: canonical JSON of the rest of tokenizer.json (normalizer,
  pre-tokenizer, post-processor, decoder) plus the named special tokens and EOS ids.
- chat template (and training chat template: Kiln trains with the template it serves): its UTF-8 text.
- model configuration: canonical JSON of the parsed `ModelConfig`.
- effective inference configuration: canonical JSON of the object GET /v1/config shows as
  `effective_inference_config`.
- prompt messages: compact JSON (fields in struct order, no key sorting) of the request messages:
  role, content (text parts joined, null as ""), then tool_calls, name, tool_call_id when present.
- scored payload: compact JSON `{"schema": "kiln.scored-rollout-payload.v1", "text", "trajectory": []}`
  with the response's final content as text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.sampling import SamplingParams
from kiln.store.atomic import atomic_write_json, canonical_json
from kiln.store.hashing import sha256_file, sha256_hex, sha256_tagged

log = logging.getLogger("kiln.engine")

SCHEMA = "kiln.rollout-provenance.v1"
PAYLOAD_SCHEMA = "kiln.scored-rollout-payload.v1"
IDENTITY_CACHE_SCHEMA = "kiln.weights-identity.v1"
IMPLEMENTATION = "kiln"
MAX_INPUT_TOKENS = 16_777_216
MAX_STOPS = 256
MAX_STOP_BYTES = 16_384
MAX_TEMPLATE_KWARGS = 256
MAX_INVOCATION_BYTES = 1_048_576


def tagged(obj: Any) -> str:
    return sha256_tagged(canonical_json(obj))


# ---- base weights ----------------------------------------------------------------------------------

def weight_files(path: Path) -> tuple[str, list[Path]]:
    if path.is_file():
        return "gguf", [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weight files to identify")
    return "hf-safetensors", files


def _cache_paths(path: Path, data_dir: Path) -> list[Path]:
    beside = path / ".kiln-weights-identity.json" if path.is_dir() else path.with_name(path.name + ".kiln-identity.json")
    fallback = data_dir / "cache" / "weights-identity" / (sha256_hex(str(path.resolve()).encode()) + ".json")
    return [beside, fallback]


def base_model_sha256(path: str | Path, data_dir: str | Path) -> str:
    """The canonical content hash of the weights at `path`, from the cache when it still matches."""
    path = Path(path)
    fmt, files = weight_files(path)
    stats = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in files}
    candidates = _cache_paths(path, Path(data_dir))
    for cache in candidates:
        cached = _read_cache(cache, stats)
        if cached is not None:
            return cached
    manifest = {"format": fmt, "files": [{"name": f.name, "sha256": sha256_file(f), "size": f.stat().st_size}
                                         for f in files]}
    digest = tagged(manifest)
    record = {"schema": IDENTITY_CACHE_SCHEMA, "base_model_sha256": digest, "manifest": manifest,
              "stat": {name: {"size": s, "mtime_ns": m} for name, (s, m) in stats.items()}}
    for cache in candidates:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(cache.parent, os.W_OK):
                continue
            atomic_write_json(cache, record)
            break
        except OSError:
            continue
    else:
        log.warning("could not cache the weights identity of %s anywhere", path)
    return digest


def _read_cache(cache: Path, stats: dict[str, tuple[int, int]]) -> str | None:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if data.get("schema") != IDENTITY_CACHE_SCHEMA:
        return None
    seen = {name: (v.get("size"), v.get("mtime_ns")) for name, v in (data.get("stat") or {}).items()}
    return data.get("base_model_sha256") if seen == stats else None


# ---- tokenizer, template, model config ---------------------------------------------------------------

@dataclass(frozen=True)
class ServingIdentity:
    base_model_sha256: str
    tokenizer_vocab_sha256: str
    tokenizer_config_sha256: str
    chat_template_sha256: str
    model_config_sha256: str

    def config_hashes(self, effective_config_sha256: str) -> dict[str, str]:
        """`ConfigHashes` for chat metadata."""
        return {
            "tokenizer_config_hash": self.tokenizer_config_sha256,
            "chat_template_hash": self.chat_template_sha256,
            "training_chat_template_hash": self.chat_template_sha256,
            "model_config_hash": self.model_config_sha256,
            "effective_config_hash": effective_config_sha256,
        }


def tokenizer_hashes(tokenizer: Any) -> tuple[str, str]:
    """(vocab_sha256, config_sha256) of a kiln Tokenizer."""
    spec = json.loads(tokenizer.backend.to_str())
    vocab = {"model": spec.get("model"), "added_tokens": spec.get("added_tokens")}
    config = {k: v for k, v in spec.items() if k not in ("model", "added_tokens")}
    config["special_tokens"] = {
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
        "eos_token_ids": list(tokenizer.eos_token_ids),
    }
    return tagged(vocab), tagged(config)


def serving_identity(weights_path: str | Path, data_dir: str | Path, tokenizer: Any, chat_template: str,
                     model_config: Any, base_sha256: str | None = None) -> ServingIdentity:
    """`base_sha256`: the weights' `base_model_sha256`, when the caller has it already."""
    vocab, config = tokenizer_hashes(tokenizer)
    return ServingIdentity(
        base_model_sha256=base_sha256 or base_model_sha256(weights_path, data_dir),
        tokenizer_vocab_sha256=vocab,
        tokenizer_config_sha256=config,
        chat_template_sha256=sha256_tagged(chat_template.encode("utf-8")),
        model_config_sha256=tagged(dataclasses.asdict(model_config)),
    )


# ---- per request --------------------------------------------------------------------------------------

def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


_TEXT_PARTS = ("text", "input_text", "output_text")


def _content_text(content: Any) -> str:
    # Not kiln.core.messages.message_text: the content identity hashes exactly the typed text parts,
    # and changing which parts count would change every stored identity.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content
                   if isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str))


def core_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request messages in core struct field order: role, content (text parts joined; null -> ""),
    then tool_calls (non-empty), name, tool_call_id when present."""
    out = []
    for m in messages:
        core: dict[str, Any] = {"role": m.get("role"), "content": _content_text(m.get("content"))}
        for key in ("tool_calls", "name", "tool_call_id"):
            if m.get(key):
                core[key] = m[key]
        out.append(core)
    return out


def prompt_messages_sha256(messages: Sequence[dict[str, Any]]) -> str:
    return sha256_tagged(_compact(core_messages(messages)))


def scored_payload_sha256(text: str) -> str:
    return sha256_tagged(_compact({"schema": PAYLOAD_SCHEMA, "text": text, "trajectory": []}))


@dataclass
class PolicyIdentity:
    served_model_id: str
    identity: ServingIdentity
    inference_config_sha256: str
    backend: str
    adapter: tuple[str, str] | None = None  # (name, content sha256) when a saved adapter generated


def rollout_provenance(
    *,
    policy: PolicyIdentity,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    forced: Sequence[bool],
    messages: Sequence[dict[str, Any]],
    response_text: str,
    template_kwargs: dict[str, Any] | None,
    params: SamplingParams,
    stops: Sequence[str],
    budget_limits: dict[str, int] | None,
    close_ids: Sequence[int],
) -> dict[str, Any]:
    """The `RolloutProvenanceV1` record of one generated choice, fields in serialization order."""
    base = len(prompt_ids)
    actions = []
    for i, tok in enumerate(token_ids):
        is_forced = bool(forced[i]) if i < len(forced) else False
        lp = None if is_forced else logprobs[i]
        actions.append({"sequence_index": base + i, "token_id": int(tok),
                        "source": "forced" if is_forced else "sampled", "behavior_logprob": lp})
    sampling: dict[str, Any] = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "max_tokens": params.max_tokens, "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "stop": list(stops),
    }
    if budget_limits:
        sampling["thinking_budget"] = {**budget_limits, "close_token_ids": list(close_ids)}
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "input_token_ids": [*map(int, prompt_ids), *map(int, token_ids)],
        "prompt_token_count": base,
        "prompt_messages_sha256": prompt_messages_sha256(messages),
        "scored_payload_sha256": scored_payload_sha256(response_text),
        "action_tokens": actions,
        "behavior_policy": {
            "served_model_id": policy.served_model_id,
            "base_model_sha256": policy.identity.base_model_sha256,
            **({"adapter": {"name": policy.adapter[0], "content_sha256": policy.adapter[1]}}
               if policy.adapter else {}),
            "inference_config_sha256": policy.inference_config_sha256,
            "implementation": IMPLEMENTATION,
        },
        "tokenizer": {
            "vocab_sha256": policy.identity.tokenizer_vocab_sha256,
            "config_sha256": policy.identity.tokenizer_config_sha256,
            "chat_template_sha256": policy.identity.chat_template_sha256,
        },
    }
    if template_kwargs:
        record["template_invocation"] = {"template_kwargs": dict(template_kwargs)}
    record["sampling"] = sampling
    record["seed"] = int(params.seed or 0)
    record["generation_backend"] = policy.backend
    return record


def provenance_problems(record: dict[str, Any]) -> list[str]:
    """§6.4 rules the JSON schema cannot state; empty when the record is valid."""
    problems = []
    ids = record["input_token_ids"]
    count = record["prompt_token_count"]
    if not 1 <= len(ids) <= MAX_INPUT_TOKENS:
        problems.append(f"input_token_ids has {len(ids)} entries")
    if not 1 <= count <= len(ids):
        problems.append("prompt_token_count is outside 1..len(input_token_ids)")
    actions = record["action_tokens"]
    if not actions:
        problems.append("there are no action tokens")
    last = count - 1
    for a in actions:
        idx = a["sequence_index"]
        if not (count <= idx < len(ids)) or idx <= last:
            problems.append(f"action sequence_index {idx} is out of order or range")
        elif ids[idx] != a["token_id"]:
            problems.append(f"action token {a['token_id']} differs from input_token_ids[{idx}]")
        last = idx
        if a["source"] == "sampled" and not (isinstance(a["behavior_logprob"], float | int)
                                             and a["behavior_logprob"] <= 1e-6):
            problems.append(f"sampled token at {idx} has logprob {a['behavior_logprob']!r}")
    if not any(a["source"] == "sampled" for a in actions):
        problems.append("no action token was sampled (all were forced)")
    close = (record["sampling"].get("thinking_budget") or {}).get("close_token_ids", [])
    for a in actions:
        if a["source"] == "forced" and a["token_id"] not in close:
            problems.append(f"forced token {a['token_id']} is not in the close sequence")
    for name in ("served_model_id", "implementation"):
        problems += _identity_text(record["behavior_policy"][name], name, 256)
    problems += _identity_text(record["generation_backend"], "generation_backend", 64)
    stops = record["sampling"]["stop"]
    if len(stops) > MAX_STOPS or sum(len(s.encode()) for s in stops) > MAX_STOP_BYTES or any(not s for s in stops):
        problems.append("stop sequences exceed 256 entries / 16384 bytes or contain an empty one")
    inv = record.get("template_invocation")
    if inv is not None and len(_compact(inv)) > MAX_INVOCATION_BYTES:
        problems.append("template_invocation is larger than 1 MiB")
    return problems


def _identity_text(value: str, name: str, max_bytes: int) -> list[str]:
    if not value or value != value.strip() or len(value.encode()) > max_bytes \
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return [f"{name} {value!r} is not non-empty, trimmed text without control characters of "
                f"at most {max_bytes} bytes"]
    return []
