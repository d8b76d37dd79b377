"""The eval system's pure core (no torch, no engine).

suite / suite_files / suite_store: suites, their validation, files and registry. scorers/: one module
per scorer kind plus the registry (`score_completion`). outcome: build an ExampleOutcome from a
generated Completion. aggregate / metrics / result: reduce k completions per example and produce the
SuiteResult (`aggregate_suite`). seeds, stats, thinking: per-completion seeds, Wilson intervals and the
reasoning split. A job runner only generates completions and calls `build_outcome` and `aggregate_suite`.
Models are reached through the `Generator` protocol (generator.py): the in-process engine
(kiln.engine.eval_generator) or any OpenAI-compatible server (remote_generator).

Imports: kiln.core, kiln.data, kiln.store, kiln.config / kiln.errors; never torch, engine or api.
"""
