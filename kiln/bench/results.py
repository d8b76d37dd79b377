"""The result of one `kiln bench` run: rows of metrics, one value per engine, plus notes.

Measurements append rows as they go, so a later measurement family (adapters, the learning loop)
adds its own rows without this module knowing about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.bench.machine import MachineInfo
from kiln.bench.stats import speedup

KILN = "kiln"
LLAMACPP = "llama.cpp"
TRANSFORMERS = "transformers"
ENGINES = (KILN, LLAMACPP, TRANSFORMERS)
# The engine a Kiln figure is compared with: llama.cpp when it measured the row, else transformers.
REFERENCE_ORDER = (LLAMACPP, TRANSFORMERS)


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

    def reference(self) -> tuple[str, float] | None:
        for engine in REFERENCE_ORDER:
            if engine in self.values and engine not in self.incomparable:
                return engine, self.values[engine]
        return None

    def kiln_ratio(self) -> float | None:
        ref = self.reference()
        if ref is None:
            return None
        return speedup(self.values.get(KILN), ref[1], self.spec.higher_is_better)


@dataclass
class BenchResult:
    machine: MachineInfo
    options: dict[str, str] = field(default_factory=dict)    # what was run: tokens, prompts, streams...
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # engine -> why it was not measured
    complete: bool = True        # False while engines remain: a checkpoint of a run still going

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
        """Engines with a value or a reason for having none, in the canonical column order."""
        present = {e for r in self.rows for e in r.values} | set(self.unavailable)
        known = [e for e in ENGINES if e in present]
        return known + sorted(present - set(ENGINES))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
