"""`kiln serve`: load a model and serve the OpenAI-compatible API."""

from __future__ import annotations

import logging
import sys
import threading

from kiln.config import ConfigError, load_settings


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Load a model and serve the OpenAI chat API. Settings: flags > KILN_<SECTION>_<FIELD> "
        "environment > TOML config > defaults (see kiln.example.toml).",
    )
    p.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8420)")
    p.add_argument("--served-model-id", help="model id reported by the API (default: the model's file name)")
    p.add_argument("--config", help="TOML config file (default: $KILN_CONFIG or ./kiln.toml)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weight dtype")
    p.add_argument("--quantization", choices=["none", "gguf", "q8_0", "q4_1"],
                   help="serve with quantized weights and 8-bit activations (CPU kernels): 'gguf' keeps a GGUF's "
                   "own Q4/Q8 blocks; default none")
    p.add_argument("--data-dir", help="where datasets, suites, judgments and adapters live (default ./kiln-data)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level (default info)")
    p.set_defaults(func=_run)


def _overrides(args) -> dict[str, dict]:
    pairs = {
        ("model", "path"): args.model, ("server", "host"): args.host, ("server", "port"): args.port,
        ("model", "served_model_id"): args.served_model_id, ("model", "dtype"): args.dtype,
        ("model", "quantization"): args.quantization,
        ("data", "data_dir"): args.data_dir, ("server", "log_level"): args.log_level,
    }
    out: dict[str, dict] = {}
    for (section, key), value in pairs.items():
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out


def uvicorn_config(settings, app):
    import uvicorn

    return uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                          log_level=settings.server.log_level, timeout_graceful_shutdown=5)


def _run(args) -> int:
    try:
        settings = load_settings(args.config, _overrides(args))
    except ConfigError as e:
        print(f"kiln serve: configuration error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from kiln.api.app import create_app
    from kiln.api.state import ServerState
    from kiln.engine.serving import build_engine

    state = ServerState(settings=settings)
    app = create_app(settings, state)
    server = uvicorn.Server(uvicorn_config(settings, app))

    def load() -> None:
        try:
            state.engine = build_engine(settings)
            state.attach_adapters()
        except Exception as e:  # noqa: BLE001 - a server without its model is useless: say why and stop
            logging.getLogger("kiln").exception("model failed to load")
            state.load_error = f"{type(e).__name__}: {e}"
            print(f"kiln serve: cannot load the model: {state.load_error}", file=sys.stderr)
            server.should_exit = True
            return
        # Measured, not understood: with 2 torch threads on CPU, decode ran ~10x slower (1 vs 13 tok/s on
        # SmolLM2) when the thread that loaded the weights either exited or became the actor itself.
        # Keeping it parked, with the actor on its own thread, is the fast arrangement.
        state.engine.join()

    # Load in the background so /health can answer 503 while the weights load.
    threading.Thread(target=load, name="kiln-load", daemon=True).start()
    server.run()
    recorder = state.services.recorder
    if recorder is not None:
        recorder.close()  # the request log writes what is queued
    if state.engine is not None:
        state.engine.shutdown()
    return 1 if state.load_error else 0
