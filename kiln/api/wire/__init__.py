"""Pydantic models of the request bodies the routers parse, with `to_input()` into the engine's plain
dataclasses; the contracts (kiln/contracts) are the source of their fields.

Imports: engine (the dataclasses they produce) and kiln.errors.
"""
