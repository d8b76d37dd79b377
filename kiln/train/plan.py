"""From a validated request to a runnable plan: data read and tokenized, adapter name and starting
factors settled. Everything a client can get wrong fails here, at submission, as a 4xx."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kiln.adapters.peft_format import LoraModule, ModuleKey
from kiln.errors import KilnError
from kiln.model.lora import MODULES
from kiln.train.errors import invalid
from kiln.train.grpo import GrpoWork, prepare_grpo
from kiln.train.loop import LoopConfig
from kiln.train.post_eval import PostEvalPlan, plan_post_eval
from kiln.train.requests import CommonConfig, GrpoRequest, SftRequest
from kiln.train.rewards import scorer_reward_fn
from kiln.train.sft import SftWork, prepare_sft
from kiln.train.sources import TrainingData, resolve_source

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

NAME_CODE = "invalid_adapter_name"


@dataclass
class LoraStart:
    rank: int
    alpha: float
    target_modules: list[str]
    seed: int
    base_adapter: str | None = None
    base_adapter_sha256: str | None = None
    base_factors: dict[ModuleKey, LoraModule] | None = None


@dataclass
class TrainingPlan:
    job_id: str
    job_type: str
    adapter_name: str
    overwrite: bool
    auto_load: bool
    webhook_url: str | None
    work: SftWork | GrpoWork
    loop: LoopConfig
    lora: LoraStart
    data: TrainingData
    config: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)
    post_eval: PostEvalPlan | None = None

    @property
    def gated(self) -> bool:
        """A post-training gate decides activation; auto_load waits for it (semantics.md §12.2)."""
        return self.post_eval is not None and self.post_eval.gated


def new_job_id() -> str:
    return "train-" + uuid.uuid4().hex[:16]


def plan_sft(req: SftRequest, engine: EngineView, adapters: Any, datasets: Any, suites: Any = None, *,
             job_id: str | None = None) -> TrainingPlan:
    cfg = req.config
    data = resolve_source("sft", req.examples, req.dataset, req.dataset_split, req.dataset_path, datasets)
    post_eval = plan_post_eval(req.post_eval, cfg, data, suites, adapters)
    seqs = prepare_sft(data.rows, data.labels, engine.template, engine.tokenizer, cfg.max_seq_len)
    stats = {"sequences": len(seqs), "trained_tokens_per_epoch": sum(s.num_trained for s in seqs),
             "truncated": sum(s.truncated for s in seqs)}
    return _plan("sft", cfg, SftWork(seqs), data, adapters, stats, post_eval=post_eval, job_id=job_id)


def plan_grpo(req: GrpoRequest, engine: EngineView, adapters: Any, datasets: Any, suites: Any = None, *,
              job_id: str | None = None) -> TrainingPlan:
    cfg = req.config
    data = resolve_source("grpo", req.groups, req.dataset, req.dataset_split, req.dataset_path, datasets)
    post_eval = plan_post_eval(req.post_eval, cfg, data, suites, adapters)
    reward_fn = scorer_reward_fn(req.reward_scorer.model_dump()) if req.reward_scorer else None
    prepared = prepare_grpo(data.rows, data.labels, engine.template, engine.tokenizer, cfg.max_seq_len, reward_fn)
    stats = {"groups": len(prepared.groups), "skipped_zero_variance_groups": len(prepared.skipped),
             "completions": sum(len(g.sequences) for g in prepared.groups),
             "trained_tokens_per_epoch": sum(g.num_tokens for g in prepared.groups),
             "mean_reward": prepared.mean_reward,
             "reward_source": "scorer" if reward_fn else "given"}
    if req.reward_scorer is not None:
        stats["reward_scorer"] = req.reward_scorer.model_dump()
    work = GrpoWork(prepared.groups, clip_eps=cfg.clip_epsilon, kl_coeff=cfg.kl_coeff, kl_estimator=cfg.kl_estimator)
    return _plan("grpo", cfg, work, data, adapters, stats, updates_per_step=cfg.updates_per_step, post_eval=post_eval,
                 job_id=job_id)


def _plan(job_type: str, cfg: CommonConfig, work: SftWork | GrpoWork, data: TrainingData, adapters: Any,
          stats: dict[str, Any], *, updates_per_step: int = 1, post_eval: PostEvalPlan | None = None,
          job_id: str | None = None) -> TrainingPlan:
    job_id = job_id or new_job_id()
    lora = _lora_start(cfg, adapters)
    name = _adapter_name(job_type, job_id, cfg, adapters)
    loop = LoopConfig(learning_rate=cfg.learning_rate, epochs=cfg.epochs, batch_size=cfg.batch_size,  # type: ignore[attr-defined]
                      grad_accum=cfg.gradient_accumulation_steps, seed=cfg.seed, max_grad_norm=cfg.max_grad_norm,
                      weight_decay=cfg.weight_decay, updates_per_step=updates_per_step)
    config = cfg.model_dump(exclude={"webhook_url"})
    config.update({"output_name": name, "lora_rank": lora.rank, "lora_alpha": lora.alpha,
                   "target_modules": lora.target_modules})
    return TrainingPlan(job_id, job_type, name, cfg.overwrite or name == cfg.base_adapter, cfg.auto_load,
                        cfg.webhook_url, work, loop, lora, data, config, stats, post_eval)


def _adapter_name(job_type: str, job_id: str, cfg: CommonConfig, adapters: Any) -> str:
    if cfg.output_name is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        return f"{job_type}-{stamp}-{job_id[-6:]}"
    adapters.path(cfg.output_name, param="config.output_name")  # 400 invalid_adapter_name
    continuing_in_place = cfg.output_name == cfg.base_adapter
    if adapters.exists(cfg.output_name) and not (cfg.overwrite or continuing_in_place):
        raise KilnError(409, "adapter_already_exists", f"Adapter {cfg.output_name!r} already exists.",
                        param="config.output_name",
                        hint="Pick another output_name, set config.overwrite=true, or continue it with "
                             "config.base_adapter set to the same name.")
    return cfg.output_name


def _lora_start(cfg: CommonConfig, adapters: Any) -> LoraStart:
    if cfg.base_adapter is None:
        return LoraStart(cfg.lora_rank, cfg.lora_alpha, list(cfg.target_modules), cfg.seed)
    name = cfg.base_adapter
    adapters.require(name, param="config.base_adapter")
    loaded = adapters.load_adapter(name)
    ranks = {m.a.shape[0] for m in loaded.modules.values()}
    if len(ranks) != 1:
        raise invalid(f"base adapter {name!r} mixes ranks {sorted(ranks)}; training continues uniform-rank "
                      "adapters only", param="config.base_adapter")
    rank = ranks.pop()
    modules = [m for m in MODULES if any(mod == m for _, mod in loaded.modules)]
    scales = {round(m.scale, 9) for m in loaded.modules.values()}
    if len(scales) != 1:
        raise invalid(f"base adapter {name!r} scales its modules differently (alpha_pattern); training continues "
                      "uniformly scaled adapters only", param="config.base_adapter")
    alpha = scales.pop() * rank  # alpha/r reproduces the saved scale (also for rsLoRA adapters)
    explicit = cfg.model_fields_set
    for key, theirs in (("lora_rank", rank), ("target_modules", modules)):
        ours = getattr(cfg, key)
        if key in explicit and (sorted(ours) if isinstance(ours, list) else ours) != (
                sorted(theirs) if isinstance(theirs, list) else theirs):
            raise invalid(f"config.{key} is {ours!r} but base adapter {name!r} has {theirs!r}",
                          param=f"config.{key}", hint=f"Drop config.{key}: a continued adapter keeps its shape.")
    return LoraStart(rank, alpha, modules, cfg.seed, name, loaded.content_sha256, dict(loaded.modules))
