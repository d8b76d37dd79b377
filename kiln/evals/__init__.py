"""The eval system's pure core (no torch, no engine).

suite / suite_files / suite_store: suites, their validation, files and registry. scorers/: one module
per scorer kind plus the registry (`score_completion`). outcome: build an ExampleOutcome from a
generated Completion. aggregate / metrics / result: reduce k completions per example and produce the
SuiteResult (`aggregate_suite`). seeds, stats, thinking: per-completion seeds, Wilson intervals and the
reasoning split. A job runner only generates completions and calls `build_outcome` and `aggregate_suite`.
"""
