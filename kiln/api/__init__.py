"""The HTTP surface: FastAPI routers and pydantic wire models. Each route parses (kiln.api.errors,
kiln.api.wire), makes one call into the layer that owns the work, and serializes; no preparation or
assembly lives here. `ServerState` (state.py) holds the settings, the engine and the typed `Services`
(services.py: stores and job managers), all built before any route runs by kiln.server.build_server.
What was served or refused reaches the metrics, the recent-request ring, the request log and the access
line through one `TrafficObserver` (observer.py).

Imports: anything below it (engine, adapters, train, evals, data, core, model, store); nothing imports
kiln.api except kiln.server (which assembles it), the commands and the tests.
"""

