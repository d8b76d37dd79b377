"""On-disk primitives (no torch): atomic writes and fsynced JSONL, the one strict JSON reader, hashes,
resource names that are safe path segments, clocks and file locks. Every layer that persists state
writes through here, so a kill at any moment leaves either the old or the new file.

Imports: the standard library and kiln.errors only.
"""

