"""The `kiln` subcommands, one module each (serve, chat, eval, bench, adapters, train, datasets,
judgments, corrections, requests, ...), registered by kiln/cli.py. `serve` builds the app and the engine
in-process; every other command is a client of a running server over HTTP (kiln/commands/client.py),
so what the CLI can do the API can do.

Imports: anything below it (api for serve, evals, train, adapters, data, store, model, engine, bench,
config, errors); nothing imports it but kiln/cli.py.
"""
