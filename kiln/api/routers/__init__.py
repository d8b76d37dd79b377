"""One FastAPI router per area, mounted by kiln/api/app.py (ROUTER_MODULES). Each route parses the
body (kiln/api/wire), makes one call into engine/adapters/train/evals/data, and serializes the result.

Imports: api (state, errors, wire), engine, adapters, train, evals, data, store.
"""
