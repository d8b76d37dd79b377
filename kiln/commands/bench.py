"""`kiln bench`: measure Kiln against llama.cpp and transformers on the same weights."""

from __future__ import annotations

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
    p.add_argument("--model", help="GGUF file or HF model directory (default: embedded SmolLM2-135M-Instruct)")
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
                   "starting one; --model must name the model it serves (for the tokenizer and the references)")
    p.add_argument("--threads", type=int, help="CPU threads for every engine (default: all available cores)")
    p.add_argument("--quantization", choices=["auto", "none", "gguf", "gguf-float", "q8_0", "q4_1"], default="auto",
                   help="weights of the Kiln servers the bench starts (kiln serve --quantization); auto "
                   "(default): the default weights (none) and, for a .gguf, also its own quantized blocks (gguf, "
                   "what llama-server runs)")
    p.set_defaults(func=_run)


def _options(args):
    from kiln.bench.options import BenchOptions

    model = args.model
    if model is None:
        from kiln.model.loader import default_model_path

        model = str(default_model_path())
    overrides: dict[str, object] = {
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
        options = _options(args)
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
