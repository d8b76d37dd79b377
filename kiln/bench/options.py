"""What one `kiln bench` run measures: workload sizes for the full and the `--quick` runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path


def default_threads() -> int:
    """Every core this process may use: the same for Kiln, llama.cpp and transformers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class BenchOptions:
    model_path: str
    synthetic: str | None = None         # what --synthetic made model_path, in words
    quick: bool = False
    skip_reference: bool = False
    only: tuple[str, ...] = ()          # measurement names; empty = all
    out: Path = Path("benchmarks/RESULTS.md")
    threads: int = field(default_factory=default_threads)
    kiln_url: str | None = None          # measure this running server instead of starting one
    # kiln serve --quantization; auto: the default weights (what `kiln serve` serves) and, for a GGUF,
    # its own blocks too (`gguf`, what llama-server runs): both measured against llama-server
    quantization: str = "auto"
    # "native": the CPU's best ISA; "avx2": Kiln forced to AVX2 against llama-server built for AVX2.
    # Empty: native, plus the AVX2 pair when the CPU has AVX-512.
    isas: tuple[str, ...] = ()
    llama_server: str | None = None       # llama-server binaries (see kiln/bench/llama_server.py)
    llama_server_avx2: str | None = None
    build_llama_server: str | None = None  # a script that builds them (ISA=native|avx2 SCRIPT)
    transformers: bool = False           # also measure transformers' generate() single-stream
    max_tokens: int = 128                # generated tokens per request (ignore_eos)
    single_prompt_tokens: tuple[int, ...] = (100, 500)
    single_repeats: int = 3              # the median of these is reported
    concurrency_levels: tuple[int, ...] = (1, 8, 16, 32, 64)
    requests_per_stream: int = 1         # each stream sends this many requests back to back
    concurrent_prompt_tokens: int = 100
    itl_streams: int = 8
    itl_max_tokens: int = 128
    itl_long_prompt_tokens: int = 2000
    itl_trigger_tokens: int = 16         # tokens each stream has produced when the long prompt is sent
    warmup_prompt_tokens: int = 64
    adapter_streams: int = 8             # multi-adapter case: these streams ...
    adapter_count: int = 4               # ... spread over this many random adapters
    adapter_rank: int = 16
    adapter_repeats: int = 2             # base and mixed runs alternate; the median of each is reported
    training_streams: int = 4            # streams whose ITL is measured with and without training
    learning_loop_timeout_s: float = 900.0

    @classmethod
    def preset(cls, model_path: str, *, quick: bool = False, **overrides: object) -> BenchOptions:
        base = cls(model_path=model_path, quick=quick)
        if quick:
            base = replace(base, max_tokens=32, single_repeats=1, concurrency_levels=(8, 32),
                           itl_max_tokens=32, itl_trigger_tokens=8,
                           itl_long_prompt_tokens=1000, adapter_repeats=1)
        return replace(base, **overrides)  # type: ignore[arg-type]

    @property
    def kiln_quantizations(self) -> tuple[str, ...]:
        """The Kiln servers the bench starts on each ISA, the default weights first (the one the
        Kiln-only measurements run on). A running server (--kiln-url) is one column: it serves what it
        was started with, and a second column of the same prompts would meet them in its prefix cache."""
        if self.quantization != "auto" or self.kiln_url:
            return (self.quantization,)
        return ("auto", "gguf") if Path(self.model_path).suffix == ".gguf" else ("auto",)

    def bench_isas(self, cpu_isas: list[str]) -> tuple[str, ...]:
        """The ISAs to measure: "native" (the CPU's best), and "avx2" when asked or, by default, when the
        CPU has AVX-512 (so both ISAs get ratios)."""
        if self.isas:
            return self.isas
        return ("native", "avx2") if "avx512" in cpu_isas and not self.kiln_url else ("native",)

    def describe(self) -> dict[str, str]:
        quant = ("set by the running server" if self.kiln_url else
                 ", ".join(f"{q} (kiln serve --quantization {q})" for q in self.kiln_quantizations))
        return {
            "model": self.model_path + (f" ({self.synthetic})" if self.synthetic else ""),
            "Kiln weights": quant,
            "mode": "quick" if self.quick else "full",
            "generated tokens per request": f"{self.max_tokens} (temperature 0, ignore_eos)",
            "single-stream prompts (target tokens)": ", ".join(map(str, self.single_prompt_tokens)),
            "single-stream repeats (median reported)": str(self.single_repeats),
            "concurrent streams": ", ".join(map(str, self.concurrency_levels))
            + f" × {self.requests_per_stream} request(s) each, ~{self.concurrent_prompt_tokens}-token prompts",
            "ITL case": f"{self.itl_streams} streams × {self.itl_max_tokens} tokens; a ~{self.itl_long_prompt_tokens}"
            f"-token prompt arrives after {self.itl_trigger_tokens} tokens each",
            "multi-adapter case": f"{self.adapter_streams} streams over {self.adapter_count} random rank-"
            f"{self.adapter_rank} adapters vs {self.adapter_streams} base streams, ~{self.concurrent_prompt_tokens}"
            f"-token prompts, median of {self.adapter_repeats} alternating run(s)",
            "training case": f"SFT of 8 examples (3 epochs) to the first correct answer; ITL p99 of "
            f"{self.training_streams} streams × {self.itl_max_tokens} tokens with and without a training job",
            "threads": str(self.threads),
            "Kiln server": self.kiln_url or "started by kiln bench",
        }
