"""Output grammars with llguidance: compile (with limits, cached), one matcher per choice, masks per step.

`GrammarCompiler.compile` turns a request's `OutputGrammar` (kiln.core.output_grammar) into a
`CompiledGrammar` or a 400 naming the field: an unresolvable `$ref`, an unsatisfiable schema, a keyword
llguidance cannot enforce, a Lark / regex error, a grammar past the limits, or one whose compile runs past
the wall-clock deadline (`COMPILE_TIMEOUT_S`). The compile runs on a worker thread (llguidance releases
the GIL) and the caller waits for it until the deadline; a compile that misses it finishes in the
background, bounded by the lexer fuel, and its grammar text is remembered so a repeat is refused at once.
Compiled grammars are cached by the sha256 of the canonical grammar text; each choice starts from a copy
of the cached matcher (`CompiledGrammar.start`), so n > 1 and repeated schemas pay the compile once.

`GrammarState` is one choice's matcher. On a thinking prompt it waits until the reasoning block closes
(the tokenizer's `</think>` ids) and only then constrains; from there every sampled token advances it.
`MaskBuilder.fill` computes the masks of every constrained row of a step in one llguidance call (which
releases the GIL: the runner overlaps it with the model forward).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from kiln.core.output_grammar import OutputGrammar
from kiln.engine.tokenizer import Tokenizer
from kiln.errors import KilnError

log = logging.getLogger("kiln.engine")

CACHE_SIZE = 256
# Wall-clock deadline of one compile: the limits below bound most of a compile's work, not all of it
# (a schema with thousands of numeric ranges compiles for seconds inside them).
COMPILE_TIMEOUT_S = 2.0
COMPILE_WORKERS = 2
# Compile limits: lexer fuel bounds compile time (llguidance burns ~50k units a millisecond, so about
# 40 ms here); per-step fuel and Earley items bound one mask's cost.
LIMITS = {"initial_lexer_fuel": 2_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 250_000, "max_grammar_size": 500_000, "max_items_in_row": 2000}

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarState", "MaskBuilder", "gbnf_to_lark"]


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


@dataclass
class CompiledGrammar:
    spec: OutputGrammar
    matcher: Any            # the pristine llguidance.LLMatcher every choice copies
    compile_ms: float

    def start(self, gate: list[int] | None = None) -> GrammarState:
        return GrammarState(self.spec, self.matcher.deep_copy(), list(gate) if gate else None)


@dataclass
class GrammarCounters:
    """Totals for /metrics; written by handlers (compiles) and the actor thread (masks)."""

    compiles: int = 0
    cache_hits: int = 0
    compile_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))
    masks: int = 0
    mask_seconds: float = 0.0
    mask_rows: int = 0
    failures: int = 0   # choices a grammar failed mid-generation
    requests: collections.Counter = field(default_factory=collections.Counter)   # by grammar kind
    refusals: collections.Counter = field(default_factory=collections.Counter)   # by reason

    def compile_p50_ms(self) -> float | None:
        times = sorted(self.compile_ms)
        return times[len(times) // 2] if times else None


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, counters: GrammarCounters | None = None,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._ll: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._timed_out: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="kiln-grammar")
        self.counters = counters or GrammarCounters()

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once, about 0.25 s for a 49k vocabulary)."""
        if self._ll is None:
            with self._lock:
                if self._ll is None:
                    self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                      eos_token=self.tokenizer.eos_token_ids or None)
        return self._ll

    def compile(self, spec: OutputGrammar, *, code: str) -> CompiledGrammar:
        """The compiled grammar, from the cache when this grammar text was compiled before."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.counters.cache_hits += 1
                return CompiledGrammar(spec, hit.matcher, hit.compile_ms)
            if key in self._timed_out:
                raise _timeout(spec, self.timeout_s, code)
        ll = self.ll_tokenizer
        t0 = time.perf_counter()
        future = self._pool.submit(_build, spec.grammar, ll)
        try:
            matcher, error = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._timed_out[key] = None
                while len(self._timed_out) > CACHE_SIZE:
                    self._timed_out.popitem(last=False)
            raise _timeout(spec, self.timeout_s, code) from None
        if error is not None:
            raise _refusal(spec, error, code)
        compiled = CompiledGrammar(spec, matcher, (time.perf_counter() - t0) * 1000.0)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self.counters.compiles += 1
            self.counters.compile_ms.append(compiled.compile_ms)
        return compiled


def _build(grammar: str, ll: Any) -> tuple[Any, str | None]:
    """(matcher, None), or (None, why llguidance refuses the grammar); runs on a compile worker."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=_limits())
    if is_error:
        return None, messages[0] if messages else "the grammar is invalid"
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        return None, matcher.get_error()
    return matcher, None


class GrammarRefusal(KilnError):
    """A 400 for a grammar llguidance refuses; `reason` is the metrics label."""

    def __init__(self, reason: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason


REFUSAL_REASONS = ("invalid_field", "unresolvable_ref", "unsatisfiable", "unsupported_feature", "limits",
                   "timeout", "regex_error", "compile_error")


def refusal_reason(message: str) -> str:
    """A bounded label for why llguidance refused a grammar (kiln_structured_refusals_total)."""
    low = message.lower()
    for needle, reason in (("pointer", "unresolvable_ref"), ("$ref", "unresolvable_ref"),
                           ("unsatisfiable", "unsatisfiable"), ("unimplemented", "unsupported_feature"),
                           ("unknown format", "unsupported_feature"), ("not supported", "unsupported_feature"),
                           ("fuel", "limits"), ("too large", "limits"), ("too complex", "limits"),
                           ("limit", "limits"), ("regex", "regex_error")):
        if needle in low:
            return reason
    return "compile_error"


def _refusal(spec: OutputGrammar, message: str, code: str) -> GrammarRefusal:
    message = message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"
    return GrammarRefusal(
        refusal_reason(message), 400, code, f"{spec.param}: the output grammar cannot be enforced: {message}",
        param=spec.param,
        hint="Kiln refuses what it cannot enforce rather than ignore it; simplify the schema or grammar "
             "(supported JSON Schema: types, enum, const, required, properties, items, min/max, lengths, "
             "pattern, common formats, anyOf/oneOf/allOf, local $ref).")


def _timeout(spec: OutputGrammar, timeout_s: float, code: str) -> GrammarRefusal:
    return GrammarRefusal(
        "timeout", 400, code,
        f"{spec.param}: the output grammar did not compile within {timeout_s:g} s", param=spec.param,
        hint="Simplify the schema or grammar: fewer alternatives, numeric ranges and patterns compile faster.")


class GrammarState:
    """One choice's matcher, gated behind the reasoning block on thinking prompts."""

    def __init__(self, spec: OutputGrammar, matcher: Any, gate: list[int] | None) -> None:
        self.spec = spec
        self.matcher = matcher
        self.gate = gate
        self._window: list[int] = []
        self.error: str | None = None

    @property
    def active(self) -> bool:
        return self.gate is None

    @property
    def wants_mask(self) -> bool:
        return self.active and self.error is None and not self.matcher.is_stopped()

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.active and self.error is None and self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Feed one sampled (or forced) token; sets `error` when the matcher refuses it."""
        if self.error is not None:
            return
        if self.gate is not None:
            self._window = (self._window + [token])[-len(self.gate):]
            if self._window == self.gate:
                self.gate = None
            return
        try:
            ok = self.matcher.consume_token(token)
        except Exception as e:  # noqa: BLE001 - a failing matcher fails its own choice only
            ok, self.error = False, f"grammar matcher failed: {e}"
        if not ok and self.error is None:
            self.error = f"the output grammar rejected token {token}: {self.matcher.get_error() or 'not allowed'}"

    def check(self) -> None:
        if self.error is None and self.matcher.is_error():
            self.error = f"the output grammar failed: {self.matcher.get_error()}"


class MaskBuilder:
    """Token masks of a step's constrained rows, in one llguidance call."""

    def __init__(self, vocab_size: int, counters: GrammarCounters | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.counters = counters or GrammarCounters()
        self._executor: Any = None

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        """int32 bitmask `[len(states), ceil(vocab / 32)]`, bit set = token allowed. A state whose
        matcher errs gets its error set (the actor fails that choice) and an all-allowed row."""
        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        mask = torch.full((len(states), self.words), -1, dtype=torch.int32)
        try:
            self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                                   mask.data_ptr(), self.words * 4, len(states))
        except Exception as e:  # noqa: BLE001 - fall back to one row at a time, so one bad row fails alone
            log.warning("batched grammar masks failed (%s); computing them row by row", e)
            for i, s in enumerate(states):
                try:
                    row = mask[i]
                    s.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
                except Exception as row_error:  # noqa: BLE001
                    s.error = f"grammar mask failed: {row_error}"
        for i, s in enumerate(states):
            s.check()
            if s.error is not None:
                mask[i] = -1
        c = self.counters
        c.masks += 1
        c.mask_rows += len(states)
        c.mask_seconds += time.perf_counter() - t0
        return mask
