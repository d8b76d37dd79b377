"""The HTTP surface: FastAPI routers and pydantic wire models. Each route parses (kiln.api.errors,
kiln.api.wire), makes one call into the layer that owns the work, and serializes; no preparation or
assembly lives here. `ServerState` (state.py) holds the settings, the engine and the typed `Services`
(services.py: stores and job managers, built in dependency order by the routers' `init`).

Imports: anything below it (engine, adapters, train, evals, data, core, model, store); nothing imports
kiln.api except the commands and the tests.
"""

