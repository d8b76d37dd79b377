"""The measurement families `kiln bench` runs, as a list later work can extend.

A measurement is a function `(ctx, engine) -> None` that drives one engine and records rows into
`ctx.result`. `MEASUREMENTS` is the hook: append a `Measurement` (e.g. "8 streams over 4 adapters vs
8 base streams", restricted to `engines={KILN}`) and `kiln bench --only NAME` picks it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.bench import adapter_load, training_load
from kiln.bench.client_load import Endpoint
from kiln.bench.engines import BenchEngine, KilnServerEngine, Unsupported
from kiln.bench.options import BenchOptions
from kiln.bench.prompts import BenchPrompt, PromptFactory
from kiln.bench.results import KILN, BenchResult, MetricSpec
from kiln.bench.stats import median
from kiln.errors import KilnError


@dataclass
class BenchContext:
    options: BenchOptions
    result: BenchResult
    prompts: PromptFactory
    log: Callable[[str], None] = print
    _cache: dict[tuple[int, int], BenchPrompt] = field(default_factory=dict)

    def prompt(self, n_tokens: int, seed: int) -> BenchPrompt:
        """The same (length, seed) gives every engine the same prompt; distinct seeds never share a prefix."""
        key = (n_tokens, seed)
        if key not in self._cache:
            self._cache[key] = self.prompts.chat(n_tokens, seed)
        return self._cache[key]


@dataclass(frozen=True)
class Measurement:
    name: str
    description: str
    run: Callable[[BenchContext, BenchEngine], None]
    engines: frozenset[str] | None = None    # None: every engine

    def applies_to(self, engine: BenchEngine) -> bool:
        """`engines` names engines; KILN in it means the primary Kiln server of each ISA."""
        if self.engines is None or engine.name in self.engines:
            return True
        return KILN in self.engines and engine.primary


# -- single stream ---------------------------------------------------------------------------------

def decode_spec(n: int) -> MetricSpec:
    return MetricSpec(f"single.decode_tps@{n}", "single stream", f"decode tok/s after ~{n}-token prompt",
                      "tok/s", True)


def prefill_spec(n: int) -> MetricSpec:
    return MetricSpec(f"single.prefill_tps@{n}", "single stream", f"prefill tok/s, ~{n}-token prompt",
                      "tok/s", True, 0)


def ttft_spec(n: int) -> MetricSpec:
    return MetricSpec(f"single.ttft_ms@{n}", "single stream", f"TTFT, ~{n}-token prompt", "ms", False, 0)


def measure_single(ctx: BenchContext, engine: BenchEngine) -> None:
    opts = ctx.options
    for n in opts.single_prompt_tokens:
        runs = [engine.single(ctx.prompt(n, 10_000 + n * 100 + r), opts.max_tokens)
                for r in range(opts.single_repeats)]
        ctx.result.record(decode_spec(n), engine.name, median([r.decode_tps for r in runs if r.decode_tps]))
        ctx.result.record(prefill_spec(n), engine.name, median([r.prefill_tps for r in runs if r.prefill_tps]))
        ctx.result.record(ttft_spec(n), engine.name, median([r.ttft_s * 1000 for r in runs]))
        ctx.result.options[f"~{n}-token prompt (actual)"] = f"{runs[0].prompt_tokens} tokens"
        short = [r.completion_tokens for r in runs if r.completion_tokens < opts.max_tokens]
        if short:
            ctx.result.note(f"{engine.name}: a single-stream run stopped after {min(short)} of {opts.max_tokens} "
                            "tokens (EOS was not ignored)")


# -- concurrent streams ----------------------------------------------------------------------------

def _streams(n: int) -> str:
    return f"{n} stream" if n == 1 else f"{n} streams"


def aggregate_spec(n: int) -> MetricSpec:
    return MetricSpec(f"concurrent.agg_tps@{n}", "concurrent streams", f"aggregate tok/s, {_streams(n)}",
                      "tok/s", True)


def latency_spec(n: int, q: int) -> MetricSpec:
    return MetricSpec(f"concurrent.p{q}_latency_s@{n}", "concurrent streams", f"p{q} request latency, {_streams(n)}",
                      "s", False, 2)


def _serving(engine: BenchEngine) -> None:
    if getattr(engine, "single_only", False):
        raise Unsupported("it has no server: single stream only")


def measure_concurrent(ctx: BenchContext, engine: BenchEngine) -> None:
    _serving(engine)
    opts = ctx.options
    for n in opts.concurrency_levels:
        prompts = [ctx.prompt(opts.concurrent_prompt_tokens, 20_000 + n * 1000 + i)
                   for i in range(n * opts.requests_per_stream)]
        run = engine.load(prompts, n, opts.max_tokens)
        ctx.result.record(aggregate_spec(n), engine.name, run.aggregate_tps)
        ctx.result.record(latency_spec(n, 50), engine.name, run.latency_percentile(50))
        ctx.result.record(latency_spec(n, 99), engine.name, run.latency_percentile(99))


# -- inter-token latency while a long prompt arrives -----------------------------------------------

ITL_P50 = MetricSpec("itl.p50_ms", "long prompt arrival", "ITL p50 of the decoding streams", "ms", False)
ITL_P99 = MetricSpec("itl.p99_ms", "long prompt arrival", "ITL p99 of the decoding streams", "ms", False)
ITL_SPREAD = MetricSpec("itl.p99_over_p50", "long prompt arrival", "ITL p99 / p50", "x", False, 2)
ITL_MAX = MetricSpec("itl.max_gap_ms", "long prompt arrival", "longest gap of any decoding stream", "ms", False, 0)
ITL_LONG_TTFT = MetricSpec("itl.long_ttft_ms", "long prompt arrival", "TTFT of the long prompt", "ms", False, 0)


def measure_itl(ctx: BenchContext, engine: BenchEngine) -> None:
    _serving(engine)
    opts = ctx.options
    streams = [ctx.prompt(opts.concurrent_prompt_tokens, 30_000 + i) for i in range(opts.itl_streams)]
    long_prompt = ctx.prompt(opts.itl_long_prompt_tokens, 39_999)
    run = engine.itl(streams, long_prompt, opts.itl_max_tokens, opts.itl_trigger_tokens)
    if run is None:
        return
    p50, p99 = run.gap_percentile(50), run.gap_percentile(99)
    worst = max(run.gaps_s) if run.gaps_s else None
    # a server that runs requests one at a time never had the long prompt arrive among decoding
    # streams: its figures are shown, but they measure another case, so no ratio is taken to them
    overlapped = run.triggered_after_tokens >= opts.itl_trigger_tokens
    for spec, value in ((ITL_P50, None if p50 is None else p50 * 1000), (ITL_P99, None if p99 is None else p99 * 1000),
                        (ITL_SPREAD, p99 / p50 if p50 and p99 is not None else None),
                        (ITL_MAX, None if worst is None else worst * 1000),
                        (ITL_LONG_TTFT, None if run.long_ttft_s is None else run.long_ttft_s * 1000)):
        ctx.result.record(spec, engine.name, value, comparable=overlapped)
    ctx.result.options["long prompt (actual)"] = f"{run.long_prompt_tokens} tokens"
    if not overlapped:
        ctx.result.note(f"{engine.name}: the long prompt was sent when the slowest stream had "
                        f"{run.triggered_after_tokens} tokens (a stream finished first: requests ran one at a time), "
                        "so its long-prompt rows measure another case and Kiln's are not compared with them")


# -- Kiln only: adapters and live training -------------------------------------------------------

def _kiln_server(engine: BenchEngine) -> KilnServerEngine:
    if not isinstance(engine, KilnServerEngine):
        raise Unsupported("needs Kiln's HTTP server")
    return engine


ADAPTER_BASE = MetricSpec("adapters.base_agg_tps", "multi-adapter", "aggregate tok/s, base-model streams",
                          "tok/s", True)
ADAPTER_MIXED = MetricSpec("adapters.mixed_agg_tps", "multi-adapter", "aggregate tok/s, streams spread over adapters",
                           "tok/s", True)
ADAPTER_RATIO = MetricSpec("adapters.mixed_over_base", "multi-adapter", "adapter streams / base streams",
                           "x", True, 2)


def measure_adapters(ctx: BenchContext, engine: BenchEngine) -> None:
    opts, server = ctx.options, _kiln_server(engine)
    names, uploaded = adapter_load.upload_adapters(server.endpoint, opts.model_path, opts.adapter_count,
                                                   opts.adapter_rank)
    try:
        b, m = _adapter_runs(ctx, engine, names)
    finally:
        left = adapter_load.remove_adapters(server.endpoint, uploaded)
        if left:
            ctx.result.note(f"{engine.name}: could not delete the benchmark adapters {', '.join(left)}")
    ctx.result.record(ADAPTER_BASE, engine.name, b)
    ctx.result.record(ADAPTER_MIXED, engine.name, m)
    ctx.result.record(ADAPTER_RATIO, engine.name, m / b if b and m else None)
    ctx.result.options["multi-adapter streams"] = (f"{opts.adapter_streams} streams; adapters "
                                                   f"{', '.join(names)} (round robin)")


def _adapter_runs(ctx: BenchContext, engine: BenchEngine, names: list[str]) -> tuple[float | None, float | None]:
    """Median aggregate tok/s of the base-model streams and of the same streams over the adapters."""
    opts = ctx.options
    prompts = [ctx.prompt(opts.concurrent_prompt_tokens, 50_000 + i) for i in range(opts.adapter_streams)]
    base = adapter_load.spread_over(prompts, [None])
    mixed = adapter_load.spread_over(prompts, list(names))
    engine.load(mixed[:1], 1, 4)    # the first use of an adapter loads it into the bank: not measured
    base_tps: list[float] = []
    mixed_tps: list[float] = []
    for _ in range(opts.adapter_repeats):
        for runs, batch in ((base_tps, base), (mixed_tps, mixed)):
            tps = engine.load(batch, len(batch), opts.max_tokens).aggregate_tps
            if tps:
                runs.append(tps)
    return median(base_tps), median(mixed_tps)


LEARNING_LOOP = MetricSpec("training.learning_loop_s", "live training",
                           "learning loop: SFT POST to the first correct answer", "s", False)
TRAINING_TPS = MetricSpec("training.tokens_per_sec", "live training", "training tokens/s", "tok/s", True)
TRAINING_ITL_IDLE = MetricSpec("training.itl_p99_idle_ms", "live training", "ITL p99 of the streams, no training",
                               "ms", False)
TRAINING_ITL_BUSY = MetricSpec("training.itl_p99_busy_ms", "live training", "ITL p99 of the streams while training",
                               "ms", False)
TRAINING_ITL_RATIO = MetricSpec("training.itl_p99_ratio", "live training", "ITL p99 while training / without",
                                "x", False, 2)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def measure_training(ctx: BenchContext, engine: BenchEngine) -> None:
    opts, server = ctx.options, _kiln_server(engine)
    endpoint: Endpoint = server.endpoint
    run = training_load.learning_loop(endpoint, opts.learning_loop_timeout_s)
    ctx.result.record(LEARNING_LOOP, engine.name, run.post_to_answer_s)
    ctx.result.record(TRAINING_TPS, engine.name, run.tokens_per_sec)
    if run.post_to_answer_s is None:
        ctx.result.note(f"{engine.name}: after training ({run.post_to_completed_s:.1f} s, {run.steps} steps) the answer "
                        f"did not contain the taught fact: {run.answer!r}")
    prompts = [ctx.prompt(opts.concurrent_prompt_tokens, 60_000 + i) for i in range(opts.training_streams)]
    itl = training_load.itl_while_training(endpoint, prompts, opts.itl_max_tokens)
    ctx.result.record(TRAINING_ITL_IDLE, engine.name, _ms(itl.idle_p99_s))
    ctx.result.record(TRAINING_ITL_BUSY, engine.name, _ms(itl.training_p99_s))
    ctx.result.record(TRAINING_ITL_RATIO, engine.name, itl.ratio)
    if not itl.training_overlapped:
        ctx.result.note(f"{engine.name}: the background training job ended before the streams did")


KILN_ONLY = frozenset({KILN})
MEASUREMENTS: list[Measurement] = [
    Measurement("single", "single-stream decode, prefill and TTFT", measure_single),
    Measurement("concurrent", "aggregate throughput and latency over concurrent streams", measure_concurrent),
    Measurement("itl", "inter-token latency while a long prompt arrives", measure_itl),
    Measurement("adapters", "streams spread over several adapters vs base-model streams", measure_adapters,
                KILN_ONLY),
    Measurement("training", "the learning loop, training tokens/s, ITL while training", measure_training,
                KILN_ONLY),
]


def select_measurements(only: tuple[str, ...] | list[str]) -> list[Measurement]:
    """The measurements named in `only` (all when empty), in registry order."""
    known = [m.name for m in MEASUREMENTS]
    unknown = [name for name in only if name not in known]
    if unknown:
        raise KilnError(400, "invalid_bench_measurement", f"unknown measurement(s): {', '.join(unknown)}",
                        param="only", hint=f"Choose from: {', '.join(known)} (comma-separated).")
    return [m for m in MEASUREMENTS if not only or m.name in only]
