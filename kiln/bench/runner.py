"""Run the selected measurements on Kiln and the reference engines, one engine alive at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.bench import llama_server
from kiln.bench.engines import BenchEngine, KilnServerEngine, Unsupported
from kiln.bench.machine import collect_machine_info
from kiln.bench.measurements import BenchContext, Measurement, select_measurements
from kiln.bench.model_size import describe_parameters, parameter_count
from kiln.bench.options import BenchOptions
from kiln.bench.prompts import PromptFactory
from kiln.bench.reference_hf import TransformersEngine
from kiln.bench.results import KILN, LLAMA_SERVER, BenchResult, Comparison
from kiln.errors import KilnError
from kiln.model import kernels

WARMUP_SEED = 1


def check_model_path(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise KilnError(400, "model_not_found", f"no model at {path}", param="model",
                        hint="Pass a .gguf file or an HF model directory, or omit --model for the embedded one.")


def kiln_name(quantization: str, isa: str) -> str:
    """`kiln avx512` serves the default weights (`--quantization auto`, what `kiln serve` serves);
    `kiln gguf avx512` the GGUF's own blocks."""
    return f"{KILN} {isa}" if quantization == "auto" else f"{KILN} {quantization} {isa}"


def build_engines(options: BenchOptions, result: BenchResult, eos_token_ids: list[int] | None = None,
                  cpu_isas: list[str] | None = None) -> list[BenchEngine]:
    """Per ISA: the Kiln servers (default weights first), then llama-server built for that ISA, each
    Kiln engine compared with it. One engine is alive at a time, in this order."""
    cpu_isas = cpu_isas or kernels.cpu_isas()
    engines: list[BenchEngine] = []
    for isa in options.bench_isas(cpu_isas):
        label = cpu_isas[-1] if isa == "native" else isa
        kilns = [KilnServerEngine(options.model_path, options.threads, url=options.kiln_url, quantization=q,
                                  name=kiln_name(q, label), isa=None if isa == "native" else isa, primary=i == 0)
                 for i, q in enumerate(options.kiln_quantizations)]
        engines += kilns
        if options.skip_reference:
            continue
        ref = f"{LLAMA_SERVER} {label}"
        if Path(options.model_path).suffix != ".gguf":
            result.unavailable[ref] = "the model is not a .gguf file"
        else:
            found = llama_server.locate(isa, options.llama_server if isa == "native" else options.llama_server_avx2,
                                        options.build_llama_server, best=cpu_isas[-1])
            if found.path is None:
                result.unavailable[ref] = found.how
            else:
                engines.append(llama_server.LlamaServerEngine(ref, found.path, options.model_path, options.threads,
                                                              label))
                result.options[f"{ref} binary"] = f"{found.path} ({found.how}; {llama_server.version(found.path)})"
        for k in kilns:
            result.comparisons.append(Comparison(k.name, ref, label, "default" if k.quantization == "auto"
                                                 else k.quantization))
    if options.skip_reference:
        result.note("reference engines skipped (--skip-reference): no ratios")
    elif options.transformers:
        engines.append(TransformersEngine(options.model_path, options.threads))
    result.engine_order = [e.name for e in engines] + [e for e in result.unavailable if e not in
                                                        {x.name for x in engines}]
    return engines


def run_engine(ctx: BenchContext, engine: BenchEngine, measurements: list[Measurement]) -> None:
    chosen = [m for m in measurements if m.applies_to(engine)]
    if not chosen:
        return
    ctx.log(f"{engine.name}: starting")
    try:
        engine.start()
        isa = getattr(engine, "cpu_isa", None)
        if isa:
            ctx.result.options[f"{engine.name}: kernels' ISA (its /health)"] = isa
        weights = getattr(engine, "weights", None)
        if weights:
            ctx.result.options[f"{engine.name}: weights (its /v1/config quantization)"] = weights
        engine.warmup(ctx.prompt(ctx.options.warmup_prompt_tokens, WARMUP_SEED))
        for m in chosen:
            ctx.log(f"{engine.name}: {m.description}")
            try:
                m.run(ctx, engine)
            except Unsupported as e:
                ctx.result.note(f"{engine.name} skipped {m.name}: {e}")
            except Exception as e:  # noqa: BLE001 - one broken measurement must not lose the others
                ctx.result.failures.append(f"{engine.name} / {m.name}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - an engine that does not start is reported, the rest still run
        ctx.result.failures.append(f"{engine.name}: could not start: {type(e).__name__}: {e}")
    finally:
        engine.close()


def run_bench(options: BenchOptions, log: Callable[[str], None] = print,
              engines: list[BenchEngine] | None = None,
              checkpoint: Callable[[BenchResult], None] | None = None) -> BenchResult:
    """Measure; `engines` replaces the default set (Kiln's server plus the references).

    `checkpoint` sees the partial result after each engine, so a long run that is stopped keeps what
    it measured."""
    check_model_path(options.model_path)
    measurements = select_measurements(options.only)
    result = BenchResult(machine=collect_machine_info(options.threads), options=options.describe(),
                         model_parameters=parameter_count(options.model_path))
    if result.model_parameters is not None:
        result.options["model parameters"] = describe_parameters(result.model_parameters)
    prompts = PromptFactory.for_model(options.model_path)
    ctx = BenchContext(options=options, result=result, prompts=prompts, log=log)
    if engines is None:
        engines = build_engines(options, result)
    elif not result.engine_order:
        result.engine_order = [e.name for e in engines]
    for i, engine in enumerate(engines):
        run_engine(ctx, engine, measurements)
        result.complete = i == len(engines) - 1
        if checkpoint is not None:
            checkpoint(result)
    return result
