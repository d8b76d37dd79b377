"""Run the selected measurements on Kiln and the reference engines, one engine alive at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.bench.engines import BenchEngine, KilnServerEngine, Unsupported
from kiln.bench.machine import collect_machine_info
from kiln.bench.measurements import BenchContext, Measurement, select_measurements
from kiln.bench.options import BenchOptions
from kiln.bench.prompts import PromptFactory
from kiln.bench.reference_hf import TransformersEngine
from kiln.bench.reference_llamacpp import INSTALL_HINT, LlamaCppEngine, llamacpp_status
from kiln.bench.results import LLAMACPP, BenchResult
from kiln.errors import KilnError

WARMUP_SEED = 1


def check_model_path(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise KilnError(400, "model_not_found", f"no model at {path}", param="model",
                        hint="Pass a .gguf file or an HF model directory, or omit --model for the embedded one.")


def build_engines(options: BenchOptions, result: BenchResult, eos_token_ids: list[int]) -> list[BenchEngine]:
    engines: list[BenchEngine] = [KilnServerEngine(options.model_path, options.threads, url=options.kiln_url,
                                                            quantization=options.kiln_quantization)]
    if options.skip_reference:
        result.note("reference engines skipped (--skip-reference): no ratios")
        return engines
    ok, detail = llamacpp_status()
    if not ok:
        result.unavailable[LLAMACPP] = f"{detail}; install with {INSTALL_HINT}"
    elif Path(options.model_path).suffix != ".gguf":
        result.unavailable[LLAMACPP] = "the model is not a .gguf file"
    else:
        engines.append(LlamaCppEngine(options.model_path, options.threads, eos_token_ids))
    engines.append(TransformersEngine(options.model_path, options.threads))
    return engines


def run_engine(ctx: BenchContext, engine: BenchEngine, measurements: list[Measurement]) -> None:
    chosen = [m for m in measurements if m.applies_to(engine)]
    if not chosen:
        return
    ctx.log(f"{engine.name}: starting")
    try:
        engine.start()
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
    result = BenchResult(machine=collect_machine_info(options.threads), options=options.describe())
    prompts = PromptFactory.for_model(options.model_path)
    ctx = BenchContext(options=options, result=result, prompts=prompts, log=log)
    if engines is None:
        engines = build_engines(options, result, list(getattr(prompts.tokenizer, "eos_token_ids", [])))
    for i, engine in enumerate(engines):
        run_engine(ctx, engine, measurements)
        result.complete = i == len(engines) - 1
        if checkpoint is not None:
            checkpoint(result)
    return result
