"""`kiln bench`: measure Kiln against llama.cpp and transformers on the same weights."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from kiln.errors import KilnError


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark Kiln's server against reference engines and write benchmarks/RESULTS.md",
        description="Single-stream decode/prefill/TTFT, aggregate throughput over 1-64 concurrent streams, and "
        "inter-token latency while a long prompt arrives; Kiln (its default weights and, for a GGUF, "
        "--quantization gguf) through its HTTP server against llama.cpp's own server (llama-server) on the same "
        "GGUF, in the same invocation. On an AVX-512 CPU also the AVX2 pair: Kiln forced to AVX2 against "
        "llama-server built for AVX2. Kiln alone: streams spread over 4 adapters vs base-model streams, and live "
        "training (the learning loop, training tokens/s, ITL while training).",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="GGUF file or HF model directory (default: embedded SmolLM2-135M-Instruct)")
    which.add_argument("--synthetic", metavar="SIZE[:TYPE]", help="bench a random-weight GGUF with a real model's "
                       "shapes instead of --model: SIZE 0.5b, 1b (Llama 3.2 1B), 3b (Llama 3.2 3B) or 8b (Llama "
                       "3.1 8B), all with the embedded tokenizer; TYPE q4_k_m (default), q5_k_m, q6_k, q8_0, "
                       "iq4_xs, iq4_nl or f16. The F16 file is written by kiln.bench.synthetic_gguf and turned into TYPE by "
                       "llama.cpp's own llama-quantize (taken beside the llama-server the bench uses, or built "
                       "by --build-llama-server), then benched exactly as --model PATH would be. Both files are "
                       "cached under $KILN_BENCH_MODELS or ~/.cache/kiln/bench-models (an 8b F16 file is 16 GB)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and requests (a few minutes per engine)")
    p.add_argument("--skip-reference", action="store_true", help="measure Kiln only")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary for the CPU's own ISA (default: "
                   "$KILN_LLAMA_SERVER, llama-server on PATH, or the build script's cache)")
    p.add_argument("--llama-server-avx2", metavar="PATH", help="llama-server built for AVX2 (default: "
                   "$KILN_LLAMA_SERVER_AVX2 or the build script's cache, build-avx2)")
    p.add_argument("--build-llama-server", metavar="SCRIPT", help="build a missing llama-server with this script "
                   "(run as ISA=native|avx2 SCRIPT; e.g. tools/build-llama-server in the repo; about 10 minutes per "
                   "ISA on 2 cores; default: $KILN_BUILD_LLAMA_SERVER)")
    p.add_argument("--isa", default="auto", help="ISAs to measure: native (the CPU's best), avx2, or both "
                   "comma-separated; auto (default): native, plus avx2 when the CPU has AVX-512")
    p.add_argument("--transformers", action="store_true", help="also measure transformers generate() "
                   "single-stream (slow)")
    p.add_argument("--out", default="benchmarks/RESULTS.md", help="report file (default: %(default)s)")
    p.add_argument("--only", default="", help="comma-separated measurements: "
                   "single,concurrent,itl,adapters,training (default: all)")
    p.add_argument("--kiln-url", help="measure this running Kiln server (e.g. http://127.0.0.1:8420) instead of "
                   "starting one, as one Kiln column (whatever weights it serves); --model must name the model it serves "
                   "(for the tokenizer and the references)")
    p.add_argument("--threads", type=int, help="CPU threads for every engine (default: all available cores)")
    p.add_argument("--quantization", choices=["auto", "none", "gguf", "gguf-float", "q8_0", "q4_1"], default="auto",
                   help="weights of the Kiln servers the bench starts (kiln serve --quantization); auto "
                   "(default): the default weights (none) and, for a .gguf, also its own quantized blocks (gguf, "
                   "what llama-server runs)")
    p.set_defaults(func=_run)


def _options(args, log=print):
    from kiln.bench.options import BenchOptions

    model, synthetic = args.model, None
    if args.synthetic is not None:
        model, synthetic = _synthetic_model(args, log)
    elif model is None:
        from kiln.model.loader import default_model_path

        model = str(default_model_path())
    overrides: dict[str, object] = {
        "synthetic": synthetic,
        "skip_reference": args.skip_reference, "out": Path(args.out),
        "only": tuple(name.strip() for name in args.only.split(",") if name.strip()),
        "kiln_url": args.kiln_url.rstrip("/") if args.kiln_url else None,
        "quantization": args.quantization,
        "llama_server": args.llama_server, "llama_server_avx2": args.llama_server_avx2,
        "build_llama_server": args.build_llama_server, "transformers": args.transformers,
    }
    if args.isa != "auto":
        isas = tuple(i.strip() for i in args.isa.split(",") if i.strip())
        bad = [i for i in isas if i not in ("native", "avx2")]
        if bad or not isas:
            raise KilnError(400, "invalid_isa", f"--isa takes native, avx2 or both; got {args.isa!r}", param="isa",
                            hint="e.g. --isa native,avx2")
        overrides["isas"] = isas
    if args.threads is not None:
        if args.threads <= 0:
            raise KilnError(400, "invalid_threads", "--threads must be positive", param="threads",
                            hint="Omit it to use every available core.")
        overrides["threads"] = args.threads
    return BenchOptions.preset(model, quick=args.quick, **overrides)


def _synthetic_model(args, log) -> tuple[str, str]:
    """(path, description) of --synthetic's cached GGUF, made first where missing (see
    kiln/bench/synthetic_models.py); llama-quantize is looked for beside the llama-server the bench
    uses only when the quantized file has to be made."""
    from kiln.bench import llama_server, synthetic_models
    from kiln.bench.options import default_threads

    spec = synthetic_models.SyntheticSpec.parse(args.synthetic)

    def find_quantize() -> str | None:
        from kiln.model import kernels

        server = llama_server.locate("native", args.llama_server, args.build_llama_server,
                                     best=kernels.cpu_isas()[-1])
        found = synthetic_models.locate_quantize(server.path)
        script = args.build_llama_server or os.environ.get(llama_server.BUILD_ENV)
        if found.path is None and script and server.how.startswith("built earlier"):
            # a cached llama-server from before the build script made llama-quantize beside it: the
            # script, run again, builds llama-quantize (a cached llama-server counts only beside it)
            rebuilt = llama_server.run_build_script("native", script)
            found = synthetic_models.locate_quantize(rebuilt.path) if rebuilt.path else found
        log(f"llama-quantize: {found.path} ({found.how})" if found.path else found.how)
        return found.path

    threads = args.threads if args.threads and args.threads > 0 else default_threads()
    path = synthetic_models.prepare(spec, find_quantize, threads=threads, log=log)
    return str(path), spec.describe()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(args) -> int:
    from rich.console import Console

    from kiln.bench.report import print_report, write_results
    from kiln.bench.runner import run_bench

    console = Console()
    if not console.is_terminal:   # a log file: do not squeeze the table into 80 columns
        console = Console(width=160)
    # SIGTERM unwinds like Ctrl-C, so the servers this run started are stopped on the way out.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        options = _options(args, log=lambda msg: console.print(f"[dim]{msg}[/]"))
        result = run_bench(options, log=lambda msg: console.print(f"[dim]{msg}[/]"),
                           checkpoint=lambda partial: write_results(partial, options.out))
    except KilnError as e:
        print(f"kiln bench: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kiln bench: interrupted; {args.out} holds the engines measured so far", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(result, console)
    console.print(f"wrote {options.out}")
    return 1 if result.failures else 0
