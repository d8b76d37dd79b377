"""A training request's `post_eval` block, checked at submission (semantics.md §8.14).

Two scopes:
- "held-out" (default): the suite must not overlap the training rows (overlap.py; 400 otherwise).
  The job is gated: after training the adapter is NOT activated; an eval job (submission_kind
  post_training, PostEvalGate attached) runs the baseline and the candidate and the paired gate
  (kiln/evals/gate.py) decides. min_accuracy defaults to 0 (the PostEvalGate object requires one).
- "train-set-eval": measures the training data itself, so it gates nothing: min_accuracy,
  relative_recovery, absolute_gain and auto_load_on_pass are refused (400); config.auto_load applies
  as usual and the eval job only reports.

The gated baseline run is always made, since the paired gate needs it; `include_baseline` adds a
baseline run to an ungated train-set-eval job. auto_load_on_pass defaults to config.auto_load.
A gated job may not replace an existing adapter (overwrite, or continuing one in place): the old
weights would be gone before the gate had decided, which is not failing closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.evals.gate import POLICY, GateThresholds
from kiln.evals.generation import GenerationParams
from kiln.evals.runner import check_completions_per_example
from kiln.evals.suite import EvalSuite, resolve_examples, suite_hash
from kiln.train.errors import invalid
from kiln.train.overlap import find_overlaps
from kiln.train.requests import CommonConfig, PostEvalRequest
from kiln.train.sources import TrainingData

HELD_OUT, TRAIN_SET = "held-out", "train-set-eval"
GATE_ONLY = ("min_accuracy", "relative_recovery", "absolute_gain", "auto_load_on_pass", "publish_on_pass")
SHOWN_OVERLAPS = 5


@dataclass
class PostEvalPlan:
    suite: EvalSuite                     # the suite as checked at submission (what the eval job runs)
    data_scope: str
    generation: GenerationParams | None
    gate: GateThresholds | None          # None: report only (train-set-eval)
    include_baseline: bool
    settings: dict[str, Any]             # recorded on the training job as `post_eval`

    @property
    def gated(self) -> bool:
        return self.gate is not None


def _reparam(e: KilnError, param: str) -> KilnError:
    e.param = param
    return e


def _suite(name: str, suites: Any) -> EvalSuite:
    if suites is None:
        raise KilnError(503, "eval_registry_unavailable", "the eval suite registry is not available",
                        param="post_eval.suite", hint="Train without post_eval and evaluate afterwards.")
    try:
        return suites.get(name)
    except KilnError as e:  # 400 invalid_suite_name / 404 eval_suite_not_found, as POST /v1/eval/run answers
        raise _reparam(e, "post_eval.suite") from None


def _generation(raw: dict[str, Any] | None, suite: EvalSuite) -> GenerationParams | None:
    generation = None
    if raw is not None:
        try:
            generation = GenerationParams.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            param = "post_eval.generation" + (f".{loc}" if loc else "")
            raise invalid(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None
    try:
        check_completions_per_example(resolve_examples(suite, generation), suite.k)
    except KilnError as e:
        raise _reparam(e, "post_eval.generation.n") from None
    return generation


def _check_scope(req: PostEvalRequest) -> None:
    if req.data_scope != TRAIN_SET:
        return
    for key in GATE_ONLY:
        if getattr(req, key) is not None:
            raise invalid(f"post_eval.{key} cannot be set with data_scope \"train-set-eval\": an eval on the "
                          "training data gates nothing", param=f"post_eval.{key}",
                          hint="Use data_scope \"held-out\" with a suite disjoint from the training rows to gate "
                               "the adapter; config.auto_load decides activation for train-set-eval.")


def _check_overlap(suite: EvalSuite, data: TrainingData) -> None:
    overlaps = find_overlaps(suite, data.rows, data.labels)
    if not overlaps:
        return
    shown = "; ".join(f"example {o.example_id!r}: {o.reason} ({o.row_label})" for o in overlaps[:SHOWN_OVERLAPS])
    more = f" and {len(overlaps) - SHOWN_OVERLAPS} more" if len(overlaps) > SHOWN_OVERLAPS else ""
    raise invalid(f"held-out suite {suite.name!r} overlaps the training data in {len(overlaps)} of "
                  f"{len(suite.examples)} example(s): {shown}{more}", param="post_eval.suite",
                  hint="Gate on a suite disjoint from the training rows (e.g. a dataset's holdout split), or set "
                       "post_eval.data_scope to \"train-set-eval\" to measure the training data (no gate).")


def _check_fresh_adapter(cfg: CommonConfig, adapters: Any) -> None:
    name = cfg.output_name
    if name is None:
        return
    adapters.path(name, param="config.output_name")  # 400 invalid_adapter_name before anything else
    # An existing name without overwrite is refused later with 409 adapter_already_exists.
    if name == cfg.base_adapter or (cfg.overwrite and adapters.exists(name)):
        raise invalid(f"a gated post_eval cannot replace the existing adapter {name!r}: its weights would change "
                      "before the gate decides", param="config.output_name",
                      hint="Train into a new output_name; the gate promotes it only if it passes.")


def plan_post_eval(req: PostEvalRequest | None, cfg: CommonConfig, data: TrainingData, suites: Any,
                   adapters: Any) -> PostEvalPlan | None:
    if req is None:
        return None
    _check_scope(req)
    suite = _suite(req.suite, suites)
    generation = _generation(req.generation, suite)
    settings: dict[str, Any] = {"suite": suite.name, "suite_hash": suite_hash(suite), "data_scope": req.data_scope}
    if generation is not None:
        settings["generation"] = generation.to_json()
    gate = None
    if req.data_scope == HELD_OUT:
        _check_overlap(suite, data)
        _check_fresh_adapter(cfg, adapters)
        auto = cfg.auto_load if req.auto_load_on_pass is None else req.auto_load_on_pass
        gate = GateThresholds(req.min_accuracy if req.min_accuracy is not None else 0.0,
                              req.relative_recovery, req.absolute_gain, auto)
        settings.update(gate.to_dict(), auto_load_on_pass=auto)
        if req.publish_on_pass is not None:
            settings["publish_on_pass"] = req.publish_on_pass
    settings["include_baseline"] = req.include_baseline or gate is not None
    settings["gate_policy"] = POLICY if gate is not None else None
    return PostEvalPlan(suite, req.data_scope, generation, gate, req.include_baseline or gate is not None, settings)
