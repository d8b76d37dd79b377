"""Helpers the test suite and benchmarks share: tiny generated models (tiny.py) and validation of
responses against the contracts' JSON Schemas (schemas.py, reading kiln/contracts).

Imports: contracts (and tokenizers, safetensors, torch for the tiny models); only tests and kiln/bench import it.
"""
