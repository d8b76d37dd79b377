"""From a validated request to a runnable plan: data read and tokenized, adapter name and starting
factors settled. Everything a client can get wrong fails here, at submission, as a 4xx."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kiln.adapters.peft_format import LoraModule, ModuleKey
from kiln.data.judgment_rows import JudgmentRow
from kiln.data.preferences import heldout_mask, pair_from_row, pairs_from_judgments
from kiln.errors import KilnError
from kiln.model.lora import MODULES
from kiln.train.dpo import DpoWork, prepare_dpo
from kiln.train.errors import invalid, row_invalid
from kiln.train.grpo import GrpoWork, prepare_grpo
from kiln.train.loop import LoopConfig
from kiln.train.opd import OpdWork
from kiln.train.post_eval import PostEvalPlan, plan_post_eval
from kiln.train.requests import CommonConfig, DpoRequest, GrpoRequest, SftRequest
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
    work: SftWork | GrpoWork | DpoWork | OpdWork
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


def plan_dpo(req: DpoRequest, engine: EngineView, adapters: Any, datasets: Any, suites: Any = None, *,
             job_id: str | None = None, judgments: Any = None) -> TrainingPlan:
    """Pairs from inline rows, a dataset or file of preference rows, or a judgment set's A/B rows (tie and
    skip rows left out and counted); a deterministic share of the prompts held out for the job's result."""
    cfg = req.config
    data = resolve_source("dpo", req.pairs, req.dataset, req.dataset_split, req.dataset_path, datasets,
                          judgments=req.judgments, judgment_rows=judgments.rows if judgments is not None else None)
    stats: dict[str, Any] = {}
    if data.source == "judgments":
        found = pairs_from_judgments(data.judgments or "", [JudgmentRow.from_json(r) for r in data.rows])
        pairs, labels = found.pairs, found.labels
        stats.update(ties_left_out=found.ties, skips_left_out=found.skips)
        if not pairs:
            raise invalid(f"judgment set {data.judgments!r} has no A/B judgments ({found.ties} tie, {found.skips} "
                          "skip): ties and skips carry no preference", param="judgments",
                          hint="Judge some pairs A or B first, or send the pairs inline.")
    else:
        pairs, labels = [], []
        for row, label in zip(data.rows, data.labels, strict=True):
            pair, problem = pair_from_row(row)
            if problem:
                named = re.search(r"`(\w+)`", problem)  # the field the problem names first
                raise row_invalid(label, problem, field=named.group(1) if named else None)
            pairs.append(pair)
            labels.append(label)
    mask = heldout_mask(pairs, cfg.heldout_percent)
    post_eval = plan_post_eval(req.post_eval, cfg, TrainingData([p.as_sft_row() for p in pairs], labels, data.source),
                               suites, adapters)
    prepared = prepare_dpo(pairs, labels, engine.template, engine.tokenizer, cfg.max_seq_len)
    train = [p for p, held in zip(prepared, mask, strict=True) if not held]
    heldout = [p for p, held in zip(prepared, mask, strict=True) if held]
    stats.update(pairs=len(prepared), train_pairs=len(train), heldout_pairs=len(heldout),
                 trained_tokens_per_epoch=sum(p.num_tokens for p in train),
                 truncated=sum(p.chosen.truncated or p.rejected.truncated for p in prepared))
    if cfg.min_heldout_win_rate is not None and not heldout:
        raise invalid("config.min_heldout_win_rate needs held-out pairs, and this split holds none out "
                      f"({len(prepared)} pairs, heldout_percent {cfg.heldout_percent})",
                      param="config.min_heldout_win_rate",
                      hint="Raise config.heldout_percent, add pairs with other prompts, or drop the gate.")
    work = DpoWork(train, heldout, beta=cfg.beta, loss_type=cfg.loss_type, min_win_rate=cfg.min_heldout_win_rate)
    return _plan("dpo", cfg, work, data, adapters, stats, post_eval=post_eval, job_id=job_id)


def _plan(job_type: str, cfg: CommonConfig, work: SftWork | GrpoWork | DpoWork | OpdWork, data: TrainingData, adapters: Any,
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
