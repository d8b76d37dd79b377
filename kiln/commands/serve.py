"""`kiln serve`: load a model and serve the OpenAI-compatible API."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8420)")
    p.add_argument("--served-model-id", help="model id reported by the API (default: the model's name)")
    p.add_argument("--config", help="TOML config file (default: $KILN_CONFIG or ./kiln.toml)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    raise SystemExit("kiln serve: not wired yet")
