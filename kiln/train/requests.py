"""Wire shapes of POST /v1/train/sft, /v1/train/grpo, /v1/train/dpo, /v1/train/opd and /v1/distill/self
(semantics.md §12.1).

Unknown keys are refused (a typo must not silently train with a default). Exactly one data source:
inline rows, a named dataset (+ split, default "train"), or a server-local JSONL path; DPO may name a
judgment set instead (`judgments`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.model.lora import MODULES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CommonConfig(_Strict):
    output_name: str | None = None          # new adapter name; generated when absent
    base_adapter: str | None = None         # continue from this adapter's factors
    lora_rank: int = Field(16, ge=1, le=1024)
    lora_alpha: float = Field(32.0, gt=0, allow_inf_nan=False)
    target_modules: list[str] = Field(default_factory=lambda: list(MODULES))
    epochs: int = Field(3, ge=1, le=10_000)
    batch_size: int = Field(1, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(1, ge=1, le=4096)
    max_seq_len: int = Field(2048, ge=8, le=1 << 20)
    seed: int = Field(0, ge=0, lt=1 << 63)
    max_grad_norm: float = Field(1.0, ge=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    auto_load: bool = True
    overwrite: bool = False                 # replace an existing adapter named output_name
    webhook_url: str | None = None          # overrides [training] webhook_url for this job
    checkpoint_interval: int | None = Field(None, ge=0, le=1 << 30)   # steps; overrides [training]; 0 = off

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one module")
        bad = [m for m in v if m not in MODULES]
        if bad:
            raise ValueError(f"unknown module(s) {bad}; choose from {list(MODULES)}")
        return list(dict.fromkeys(v))

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v


class SftConfig(CommonConfig):
    # 2e-4, the LoRA rate QLoRA and most PEFT recipes start from: with the other defaults (3 epochs,
    # batch 1, rank 16) eight phrasings of a made-up fact teach SmolLM2-135M the fact on every ISA,
    # where 1e-4 left it untaught (docs/semantics.md §12.1).
    learning_rate: float = Field(2e-4, gt=0, allow_inf_nan=False)


class GrpoConfig(CommonConfig):
    learning_rate: float = Field(1e-5, gt=0, allow_inf_nan=False)
    epochs: int = Field(1, ge=1, le=10_000)
    kl_coeff: float = Field(0.1, ge=0, allow_inf_nan=False)
    clip_epsilon: float = Field(0.2, gt=0, lt=1)
    # k3 by default: as a loss term k1's gradient is just grad(logp) on the given completions, which
    # pushes every one of them down instead of pulling the policy back toward the base (see grpo.py).
    kl_estimator: Literal["k1", "k3", "none"] = "k3"
    updates_per_step: int = Field(1, ge=1, le=64)   # optimizer updates per batch (mu); >1 makes the clip bite


class DpoConfig(CommonConfig):
    learning_rate: float = Field(5e-5, gt=0, allow_inf_nan=False)
    beta: float = Field(0.1, gt=0, le=100, allow_inf_nan=False)   # strength of the pull toward the reference
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    # Share of the prompts held out (all pairs of a prompt on one side) to measure the job against the
    # starting adapter; 0 trains on every pair and reports no held-out figure.
    heldout_percent: int = Field(10, ge=0, le=50)
    # A gate on the held-out pairs: below this win rate against the starting adapter the new adapter is
    # saved but not loaded (auto_load is skipped). None: no gate.
    min_heldout_win_rate: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)


class DistillConfig(CommonConfig):
    learning_rate: float = Field(2e-4, gt=0, allow_inf_nan=False)
    top_k: Literal[16, 32] = 16                          # the teacher's top-K tokens the KL runs over
    samples_per_prompt: int = Field(1, ge=1, le=16)
    max_new_tokens: int = Field(64, ge=1, le=2048)       # per completion
    temperature: float = Field(0.0, ge=0, le=2, allow_inf_nan=False)   # 0: greedy; else sampled, seeded by seed


class OpdConfig(DistillConfig):
    training_mode: Literal["on_policy", "off_policy"] = "on_policy"
    # The divergence the loss minimises over the teacher's top-K plus the rest bucket (kiln.train.opd).
    # Absent: reverse_kl on_policy (mode-seeking on the student's own samples), forward_kl off_policy
    # (mass-covering: on the teacher's text it pulls up every token the teacher favours, even ones the
    # student gives almost no mass, where reverse KL's gradient vanishes).
    objective: Literal["reverse_kl", "forward_kl", "jsd"] | None = None

    @model_validator(mode="after")
    def _default_objective(self) -> OpdConfig:
        if self.objective is None:
            self.objective = "reverse_kl" if self.training_mode == "on_policy" else "forward_kl"
        return self


class PostEvalRequest(_Strict):
    """The post-training eval and its gate (semantics.md §8.14); checked further in post_eval.py."""

    suite: str                                           # a registered eval suite
    data_scope: Literal["held-out", "train-set-eval"] = "held-out"
    generation: dict[str, Any] | None = None             # run-level override, as in POST /v1/eval/run
    min_accuracy: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    relative_recovery: float | None = Field(None, allow_inf_nan=False)
    absolute_gain: float | None = Field(None, allow_inf_nan=False)
    auto_load_on_pass: bool | None = None                # None: config.auto_load (default true)
    # replicas ("all" or names, kiln.replicas) the adapter is published to when the gate passes
    publish_on_pass: list[str] | Literal["all"] | None = None
    include_baseline: bool = False


class _Sourced(_Strict):
    dataset: str | None = None
    dataset_split: str | None = None
    dataset_path: str | None = None
    post_eval: PostEvalRequest | None = None


class SftRequest(_Sourced):
    examples: list[Any] | None = None
    config: SftConfig = Field(default_factory=SftConfig)

    @property
    def inline(self) -> list[Any] | None:
        return self.examples


class RewardScorer(_Strict):
    scorer: dict[str, Any]
    target: str | None = None


class GrpoRequest(_Sourced):
    groups: list[Any] | None = None
    reward_scorer: RewardScorer | None = None
    config: GrpoConfig = Field(default_factory=GrpoConfig)

    @property
    def inline(self) -> list[Any] | None:
        return self.groups


class DpoRequest(_Sourced):
    pairs: list[Any] | None = None          # [{messages, chosen, rejected}] (also TRL's / OpenAI's row shapes)
    judgments: str | None = None            # a judgment set: its A/B rows become pairs
    config: DpoConfig = Field(default_factory=DpoConfig)

    @property
    def inline(self) -> list[Any] | None:
        return self.pairs


class OpdRequest(_Sourced):
    prompts: list[Any] | None = None        # strings, {messages} or {prompt}
    teacher: str                            # a registered teacher's alias
    config: OpdConfig = Field(default_factory=OpdConfig)

    @property
    def inline(self) -> list[Any] | None:
        return self.prompts


class SelfDistillRequest(_Sourced):
    prompts: list[Any] | None = None        # as OPD; ground_truth_conditioning needs each row's reference answer
    mode: Literal["conciseness", "ground_truth_conditioning"]
    instruction: str | None = Field(None, min_length=1, max_length=4000)   # overrides the mode's instruction
    config: DistillConfig = Field(default_factory=DistillConfig)

    @property
    def inline(self) -> list[Any] | None:
        return self.prompts
