"""Datasets and judgments (no torch): the dataset store with deterministic splits, row formats and
ingestion, dataset stats, pairwise judgments, the judge prompt, and compiling judgments into training
rows. The API's dataset and judgment routes call these; training reads rows from the stores.

Imports: kiln.core, kiln.store, kiln.config / kiln.errors; never torch, never engine, train or api.
"""

