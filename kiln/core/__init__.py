"""Kiln's decision logic in pure Python (no torch): sequences, the paged block manager, the scheduler
(continuous batching, chunked prefill, preemption), sampling parameters and presets, the thinking
budget and its controller, stop matching, the reasoning split, tool-call parsing, message content.

Everything here is a plain function or dataclass over plain values, unit-tested without a model. The
engine (kiln.engine) drives the scheduler and budget controllers; evals and data reuse the rules.

Imports: the standard library, kiln.errors and kiln.core itself; never torch, never another layer.
"""

