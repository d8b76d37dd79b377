"""`kiln serve`: load a model and serve the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.config import ConfigError, Settings, load_settings
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.serving import Engine
    from kiln.server import Server


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Load a model and serve the OpenAI chat API. Settings: flags > KILN_<SECTION>_<FIELD> "
        "environment > TOML config > defaults (see kiln.example.toml).",
    )
    p.add_argument("model_positional", nargs="?", metavar="MODEL",
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", help="the same as MODEL, as a flag")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8420)")
    p.add_argument("--served-model-id", "--served-model-name", dest="served_model_id",
                   help="model id reported by the API (default: the model's file name)")
    p.add_argument("--config", help="TOML config file (default: $KILN_CONFIG or ./kiln.toml)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weight dtype")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the model runs (default auto)")
    p.add_argument("--quantization", choices=["auto", "none", "gguf", "gguf-float", "q8_0", "q4_1"],
                   help="the weights the serving path multiplies with (CPU kernels): 'gguf' keeps a GGUF's own "
                   "blocks (Q4_0/Q4_1/Q8_0, Q4_K/Q5_K/Q6_K) and multiplies them with 8-bit activations, as "
                   "llama.cpp does; 'gguf-float' the same blocks with float32 activations (the dequantized "
                   "weights' answers, slower on big models); 'none' the dense weights; default 'auto': a K-quant "
                   "GGUF (Q4_K_M, Q5_K_M, Q6_K) or a real-size Q4/Q8 GGUF as gguf on any CPU; a small Q4/Q8 GGUF "
                   "(at most 512 MB in bfloat16) as dense bfloat16 on AMD's AVX512-BF16 (rebuilt from its "
                   "blocks), as gguf-float on other CPUs; dense on a GPU; the startup "
                   "log says what each tensor format is served with and why")
    p.add_argument("--data-dir", help="where datasets, suites, judgments and adapters live (default ./kiln-data)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", action="extend",
                   help="PEFT adapter folders to import into the adapter store at start (as vLLM's "
                   "--lora-modules); requests then select one with model=NAME or adapter=NAME")
    eng = p.add_argument_group("engine (vLLM's names where it has one)")
    eng.add_argument("--max-num-seqs", type=int, help="sequences decoded together in one step (default 64)")
    eng.add_argument("--max-model-len", type=int,
                     help="context length ceiling (default: min(the model's, what the KV pool holds))")
    eng.add_argument("--kv-cache-memory-mb", type=int,
                     help="memory for the paged KV cache in MiB (default 0: as many tokens as 512 MiB of "
                     "bfloat16 K/V hold, whatever the KV's dtype)")
    eng.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    eng.add_argument("--max-batch-tokens", "--max-num-batched-tokens", dest="max_batch_tokens", type=int,
                     help="per-step token budget shared by decode tokens and prefill chunks (default 512)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                     help="reuse the KV blocks of shared prompt prefixes (default on)")
    eng.add_argument("--num-threads", type=int, help="torch intra-op threads; 0 keeps torch's default")
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level (default info)")
    logs.add_argument("--log-format", choices=["text", "json"],
                      help="text lines, or one JSON object per line (default text); both carry the request id")
    logs.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                      help="one line per request: status, duration, tokens, TTFT, adapter, finish (default on)")
    access = p.add_argument_group("access")
    access.add_argument("--api-key", action="append", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every call but /health (repeat for several keys; "
                        "also KILN_SERVER_API_KEYS, comma-separated)")
    access.add_argument("--api-key-file", metavar="PATH", help="file with one API key per line ('#' comments)")
    access.add_argument("--protect-metrics", action="store_true", default=None,
                        help="with API keys set, /metrics needs a key too")
    p.set_defaults(func=_run)


def _overrides(args) -> dict[str, dict]:
    model = args.model_positional or args.model
    pairs = {
        ("model", "path"): model, ("server", "host"): args.host, ("server", "port"): args.port,
        ("model", "served_model_id"): args.served_model_id, ("model", "dtype"): args.dtype,
        ("model", "device"): args.device, ("model", "quantization"): args.quantization,
        ("model", "lora_modules"): args.lora_modules,
        ("data", "data_dir"): args.data_dir, ("server", "log_level"): args.log_level,
        ("server", "log_format"): args.log_format, ("server", "access_log"): args.access_log,
        ("engine", "max_num_seqs"): args.max_num_seqs, ("engine", "max_model_len"): args.max_model_len,
        ("engine", "kv_cache_memory_mb"): args.kv_cache_memory_mb, ("engine", "block_size"): args.block_size,
        ("engine", "max_batch_tokens"): args.max_batch_tokens,
        ("engine", "enable_prefix_caching"): args.enable_prefix_caching,
        ("engine", "num_threads"): args.num_threads,
        ("server", "api_keys"): ",".join(args.api_key) if args.api_key else None,
        ("server", "api_key_file"): args.api_key_file, ("server", "protect_metrics"): args.protect_metrics,
    }
    out: dict[str, dict] = {}
    for (section, key), value in pairs.items():
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out


def uvicorn_config(settings, app):
    import uvicorn

    # log_config=None: uvicorn's loggers go through the handler configure_logging installed, and Kiln
    # writes its own access line (with the request id and the generation's numbers). lifespan="off":
    # the app has no startup/shutdown handlers (start and drain are Kiln's own, kiln/api/lifecycle.py),
    # and uvicorn's lifespan task, cancelled at exit, logged a CancelledError traceback on every stop.
    # loop/http/ws named, not "auto": the modules are imported up front (see _run) and no optional
    # package (uvloop, httptools, websockets) is probed when the server starts
    return uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                          log_level=settings.server.log_level, timeout_graceful_shutdown=5,
                          log_config=None, access_log=False, lifespan="off", loop="asyncio", http="h11",
                          ws="none")


def _warn_if_exposed(settings) -> None:
    from kiln.api.auth import is_loopback, load_api_keys

    keys = load_api_keys(settings)
    log = logging.getLogger("kiln")
    if keys:
        log.info("API keys: %d configured; every call but /health%s needs 'Authorization: Bearer KEY'", len(keys),
                 "" if settings.server.protect_metrics else " and /metrics")
    elif not is_loopback(settings.server.host):
        log.warning("binding %s without an API key: anyone who can reach this port can use the model, train and "
                    "delete adapters; pass --api-key KEY (or set KILN_SERVER_API_KEYS)", settings.server.host)


def _server_class(uvicorn):
    class KilnServer(uvicorn.Server):
        """uvicorn, but SIGTERM/SIGINT first drain (kiln/api/shutdown.py) and then exit 0; a second one
        exits at once."""

        def __init__(self, config, state) -> None:
            super().__init__(config)
            self.kiln_state = state
            self._signalled = False

        def handle_exit(self, sig, frame) -> None:
            # Not recorded in _captured_signals: uvicorn re-raises those after serving, and a re-raised
            # SIGTERM would end the process by the signal instead of with exit code 0.
            if self._signalled or self.kiln_state.engine is None:
                self.should_exit = True
                if self._signalled:
                    self.force_exit = True
                return
            self._signalled = True
            threading.Thread(target=self._drain, name="kiln-shutdown", daemon=True).start()

        def _drain(self) -> None:
            lifecycle = self.kiln_state.lifecycle
            logging.getLogger("kiln").info("shutdown requested: no new requests; draining for up to %.0fs",
                                           lifecycle.timeout)
            try:
                lifecycle.drain()
            finally:
                self.should_exit = True

    return KilnServer


class _BackgroundLoad:
    """The model, loaded on a thread of its own from the moment the settings are known: the web server's
    modules are imported and its services built meanwhile (~0.7 s of CPU on a 2-core machine, which the
    load's GIL-free C++ packing leaves room for). The engine is published once the server exists
    (`hand_over`); until then /health cannot answer at all, after it 503 while the load goes on.

    `stop` must run before the process exits: a thread left inside the kernels' C++ (the GIL released)
    while the interpreter shuts down aborts the process when it takes the GIL back."""

    def __init__(self, build: Callable[[threading.Event], Engine]) -> None:
        self._build = build   # build(cancel): the engine, or LoadCancelled once cancel is set
        self._server: tuple[Server, Any] | None = None
        self._handed = threading.Event()
        self._cancel = threading.Event()
        self._settled = threading.Event()   # published (the thread parks), or the thread is done
        self.thread = threading.Thread(target=self._run, name="kiln-load", daemon=True)
        self.thread.start()

    def hand_over(self, built: Server, server: Any) -> None:
        """The built server and uvicorn's: publish the engine to them when it is ready, or stop the server
        when the load failed."""
        self._server = (built, server)
        self._handed.set()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Before the server is closed and the process exits: a load still running stops at its next
        tensor, an engine loaded but not published shuts down. Returns once the engine is published (the
        server's close shuts it down) or the thread is done. Idempotent."""
        self._cancel.set()
        self._handed.set()
        self._settled.wait(timeout_s)

    def _run(self) -> None:
        try:
            self._load_and_publish()
        finally:
            self._settled.set()

    def _load_and_publish(self) -> None:
        from kiln.model.gguf_loader import LoadCancelled  # torch's modules: imported with the engine's

        engine, error = None, None
        try:
            engine = self._build(self._cancel)
        except LoadCancelled:
            return
        except Exception as e:  # noqa: BLE001 - a server without its model is useless: say why and stop
            logging.getLogger("kiln").exception("model failed to load")
            error = f"{type(e).__name__}: {e}"
        self._handed.wait()
        if self._cancel.is_set():   # the server stopped (or never started) while the model loaded
            if engine is not None:
                engine.shutdown()
            return
        assert self._server is not None
        built, server = self._server
        state = built.state
        if engine is None:
            state.load_error = error
            print(f"kiln serve: cannot load the model: {error}", file=sys.stderr)
            server.should_exit = True
            return
        built.publish(engine)
        self._settled.set()
        # What startup made (modules, the app, the model's Python objects) lives as long as the process:
        # frozen out of the collector's sight, its full collections stop walking it in the middle of
        # steps (vLLM does the same). 64 streams, gguf forced to AVX2: about +2% aggregate tok/s.
        # Frozen without a collection first: at 1B that pass walks ~400k objects (0.3 s on a 2-core
        # Zen 3, holding the GIL the first requests need) to find ~7k cyclic leftovers of the imports
        # (functions, cells, tuples: no tensor, no change in the resident set), which stay frozen.
        gc.freeze()
        gc.enable()
        # Measured, not understood: with 2 torch threads on CPU, decode ran ~10x slower (1 vs 13 tok/s on
        # SmolLM2) when the thread that loaded the weights either exited or became the actor itself.
        # Keeping it parked, with the actor on its own thread, is the fast arrangement.
        state.require_engine().join()


def _run(args) -> int:
    # No cyclic garbage collection until the engine is published: the imports (torch's, the web
    # server's) and the load allocate millions of long-lived objects, and the collector walked them
    # again and again (~0.3 s of a 2.5 s start at 1B on 2 cores). Re-enabled after the freeze below.
    gc.disable()
    try:
        settings = load_settings(args.config, _overrides(args))
    except ConfigError as e:
        print(f"kiln serve: configuration error: {e}", file=sys.stderr)
        return 2
    if args.model_positional and args.model and args.model_positional != args.model:
        print("kiln serve: give the model once, as MODEL or --model", file=sys.stderr)
        return 2
    from kiln.api.access_log import configure_logging

    configure_logging(settings.server.log_level, settings.server.log_format)
    # Imported here, not at the top: every `kiln` command builds its parser from this module, and only
    # serving needs torch, the model and the web server. The engine's modules (torch) are imported
    # before the load's thread starts, the web server's while it runs.
    from kiln.engine.build import build_engine

    load = _BackgroundLoad(lambda cancel: build_engine(settings, cancel=cancel))
    try:
        return _serve(settings, load)
    finally:
        load.stop()   # on every way out (a configuration error found while the model loads included)


def _serve(settings: Settings, load: _BackgroundLoad) -> int:
    # What uvicorn would import lazily once the model is loaded is imported now too.
    import uvicorn
    import uvicorn.loops.asyncio  # noqa: F401
    import uvicorn.protocols.http.h11_impl  # noqa: F401

    from kiln.server import build_server

    try:
        built = build_server(settings)
    except ConfigError as e:
        print(f"kiln serve: configuration error: {e}", file=sys.stderr)
        return 2
    _warn_if_exposed(settings)
    _, live_locks = built.sweep_stores()  # noqa: F841 - held (shared) while the server lives
    try:
        for line in built.import_lora_modules(settings.model.lora_modules):
            logging.getLogger("kiln").info("%s", line)
    except KilnError as e:
        print(f"kiln serve: --lora-modules: {e.message}" + (f" ({e.hint})" if e.hint else ""), file=sys.stderr)
        return 2
    state = built.state
    server = _server_class(uvicorn)(uvicorn_config(settings, built.app), state)
    load.hand_over(built, server)
    server.run()
    load.stop()   # a load still running stops (SIGINT while it ran), before the engine is shut down
    built.close()
    logging.getLogger("kiln").info("kiln serve stopped")
    return 1 if state.load_error else 0
