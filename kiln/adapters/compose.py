"""Per-request composition `adapters: [{name, scale}]` (semantics.md §7.5) as exact low-rank factors.

For every (layer, module) the composed delta is sum_i scale_i * s_i * B_i A_i, where s_i is adapter
i's own alpha/r (or alpha/sqrt(r)) scale. Stacking A_i along the rank axis and B_i * scale_i * s_i
side by side gives factors whose product is exactly that sum, so the result is served like any
adapter with scale 1.0. Results are cached in memory (LRU by entries and bytes) keyed by the
(name, scale) pairs and each adapter's content hash, so a changed adapter is never served stale.
Deviation: §7.5 caches on disk under .composed/; stacking is cheap, so memory suffices here.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.adapters.peft_format import LoraModule, ModuleKey
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError

MAX_COMPOSE = 16
INVALID = "invalid_compose_request"

CacheKey = tuple[tuple[str, float, str], ...]


@dataclass
class ComposedAdapter:
    key: CacheKey  # ((name, scale, content_sha256), ...)
    modules: dict[ModuleKey, LoraModule]  # every scale is 1.0
    nbytes: int

    @property
    def label(self) -> str:
        return "+".join(f"{n}*{s:g}" for n, s, _ in self.key)


def _invalid(message: str, param: str = "adapters") -> KilnError:
    return KilnError(400, INVALID, f"Invalid adapter composition: {message}", param=param,
                     hint=f"Send adapters as [{{name, scale}}] with 1 to {MAX_COMPOSE} entries and finite scales.")


def compose_modules(parts: Sequence[tuple[Mapping[ModuleKey, LoraModule], float]]) -> dict[ModuleKey, LoraModule]:
    """Stack (modules, request scale) pairs into one set of float32 factors with scale 1.0."""
    blocks: dict[ModuleKey, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for modules, scale in parts:
        for mk, lm in modules.items():
            blocks.setdefault(mk, []).append((lm.a.float(), lm.b.float() * (scale * lm.scale)))
    out: dict[ModuleKey, LoraModule] = {}
    for mk in sorted(blocks):
        pairs = blocks[mk]
        ins, outs = {a.shape[1] for a, _ in pairs}, {b.shape[0] for _, b in pairs}
        if len(ins) != 1 or len(outs) != 1:
            raise _invalid(f"layer {mk[0]} {mk[1]} has different shapes across the composed adapters")
        out[mk] = LoraModule(torch.cat([a for a, _ in pairs], dim=0), torch.cat([b for _, b in pairs], dim=1), 1.0)
    return out


def _ref_fields(ref: Any) -> tuple[Any, Any]:
    if isinstance(ref, Mapping):
        return ref.get("name"), ref.get("scale")
    if isinstance(ref, tuple) and len(ref) == 2:
        return ref
    return getattr(ref, "name", None), getattr(ref, "scale", None)


def _parse_refs(refs: Sequence[Any]) -> list[tuple[str, float]]:
    if not isinstance(refs, Sequence) or isinstance(refs, str | bytes) or not refs:
        raise _invalid("adapters must be a non-empty list")
    if len(refs) > MAX_COMPOSE:
        raise _invalid(f"at most {MAX_COMPOSE} adapters can be composed, got {len(refs)}")
    out = []
    for i, ref in enumerate(refs):
        name, scale = _ref_fields(ref)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise _invalid(f"scale of entry {i} must be a finite number", f"adapters[{i}].scale")
        out.append((name, float(scale)))
    return out


class CompositionCache:
    def __init__(self, store: AdapterStore, *, max_entries: int = 64, max_bytes: int = 10 << 30) -> None:
        self.store = store
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, ComposedAdapter] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def compose(self, refs: Sequence[Any]) -> ComposedAdapter:
        """refs: [{name, scale}] dicts, (name, scale) tuples or objects with .name/.scale."""
        pairs = _parse_refs(refs)
        for i, (name, _) in enumerate(pairs):
            self.store.require(name, param=f"adapters[{i}].name")
        key: CacheKey = tuple((n, s, self.store.content_hash(n)) for n, s in pairs)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        loaded = [(self.store.load_adapter(n), s) for n, s in pairs]
        # The files may have changed between hashing and loading; key by what was actually loaded.
        key = tuple((a.name, s, a.content_sha256) for a, s in loaded)
        modules = compose_modules([(a.modules, s) for a, s in loaded])
        nbytes = sum(lm.a.numel() * lm.a.element_size() + lm.b.numel() * lm.b.element_size()
                     for lm in modules.values())
        composed = ComposedAdapter(key, modules, nbytes)
        self._insert(composed)
        return composed

    def _insert(self, composed: ComposedAdapter) -> None:
        if composed.nbytes > self.max_bytes or self.max_entries <= 0:
            return
        with self._lock:
            old = self._entries.pop(composed.key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[composed.key] = composed
            self.bytes += composed.nbytes
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                    "max_entries": self.max_entries, "max_bytes": self.max_bytes}
