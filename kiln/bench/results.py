"""The result of one `kiln bench` run: rows of metrics, one value per engine, the comparisons between
engines (Kiln against llama-server on each ISA), plus notes.

Measurements append rows as they go, so a later measurement family (adapters, the learning loop)
adds its own rows without this module knowing about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.bench.machine import MachineInfo
from kiln.bench.stats import speedup

KILN = "kiln"                  # Kiln's engines' names start with it (and Kiln-only measurements use it)
LLAMA_SERVER = "llama-server"  # llama.cpp's own server: the reference every Kiln figure is compared with
TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class Comparison:
    """One ratio column: a Kiln engine against the reference measured on the same ISA."""

    kiln: str          # engine names, e.g. "kiln gguf avx512" and "llama-server avx512"
    reference: str
    isa: str           # avx512 | avx2 | scalar: what both ran
    weights: str       # "default" (what `kiln serve` serves by default) | "gguf" | another quantization

    @property
    def label(self) -> str:
        return f"{self.kiln} / {self.reference}"


@dataclass(frozen=True)
class MetricSpec:
    key: str                 # stable id, e.g. "single.decode_tps@100"
    section: str             # table group, e.g. "single stream"
    label: str
    unit: str
    higher_is_better: bool
    digits: int = 1


@dataclass
class Row:
    spec: MetricSpec
    values: dict[str, float] = field(default_factory=dict)   # engine -> value
    # engines whose value is shown but measured a different case (no ratio against it)
    incomparable: set[str] = field(default_factory=set)

    def ratio(self, comparison: Comparison) -> float | None:
        """How many times better the comparison's Kiln engine is than its reference on this row (None
        when either has no figure, or the reference's figure measured another case)."""
        if comparison.reference in self.incomparable:
            return None
        return speedup(self.values.get(comparison.kiln), self.values.get(comparison.reference),
                       self.spec.higher_is_better)


@dataclass
class BenchResult:
    machine: MachineInfo
    options: dict[str, str] = field(default_factory=dict)    # what was run: tokens, prompts, streams...
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # engine -> why it was not measured
    complete: bool = True        # False while engines remain: a checkpoint of a run still going
    engine_order: list[str] = field(default_factory=list)      # table columns, in the order engines ran
    comparisons: list[Comparison] = field(default_factory=list)
    model_parameters: int | None = None   # the benched model's weights' element count, when readable

    def record(self, spec: MetricSpec, engine: str, value: float | None, comparable: bool = True) -> None:
        """`comparable=False`: the engine's figure is shown, but Kiln's is not given as a ratio to it."""
        if value is None:
            return
        row = self.row(spec.key)
        if row is None:
            row = Row(spec)
            self.rows.append(row)
        row.values[engine] = float(value)
        if not comparable:
            row.incomparable.add(engine)

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.spec.key == key), None)

    def value(self, key: str, engine: str) -> float | None:
        row = self.row(key)
        return None if row is None else row.values.get(engine)

    def engines(self) -> list[str]:
        """Engines with a value or a reason for having none, in the order they were set up to run."""
        present = {e for r in self.rows for e in r.values} | set(self.unavailable)
        known = [e for e in self.engine_order if e in present]
        return known + sorted(present - set(known))

    def ratio(self, key: str, comparison: Comparison) -> float | None:
        row = self.row(key)
        return None if row is None else row.ratio(comparison)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
