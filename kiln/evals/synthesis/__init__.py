"""Eval suites synthesized from dataset conversations (semantics.md §10).

config: request bodies; conversations: rows -> conversations; targets: what an assistant turn is
graded against; strategies: the six decompositions; autodetect: scorer rules per target; sampling:
seed, SplitMix64 and reservoir; stats: the counters; pipeline: `synthesize(rows, config, ...)`.
"""

from kiln.evals.synthesis.autodetect import Detection, detect_scorer
from kiln.evals.synthesis.config import (
    PreviewBody,
    SynthesisConfig,
    SynthesizeBody,
    parse_preview_body,
    parse_synthesize_body,
)
from kiln.evals.synthesis.pipeline import SynthesisResult, synthesize
from kiln.evals.synthesis.stats import SynthesisStats
from kiln.evals.synthesis.targets import Target, extract_target

__all__ = [
    "Detection", "PreviewBody", "SynthesisConfig", "SynthesisResult", "SynthesisStats", "SynthesizeBody", "Target",
    "detect_scorer", "extract_target", "parse_preview_body", "parse_synthesize_body", "synthesize",
]
