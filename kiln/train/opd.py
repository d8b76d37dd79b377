"""Distillation from a teacher (OPD) and self-distillation: the student learns the teacher's per-token
distribution on completions, by a divergence (reverse KL, forward KL or JSD) over the teacher's top-K tokens.

Items are (prompt, sample) pairs. Before the first step (`prepare`, on the job's starting factors) each
item gets its completion and the teacher's top-K log-probabilities at every completion (action) token:
- on_policy: the student (the base wearing the starting adapter) writes the completion, greedily at
  temperature 0, else sampled from a generator seeded by (config.seed, item index);
- off_policy: the teacher writes it, the same way.
Both use the training forward without a KV cache (see `generate`), so a resumed job computes the same
completions and the same teacher numbers again from the same start.

The teacher is the same base model wearing its own factors (a registered local teacher's adapter, the bare
base, or -- self-distillation -- the starting adapter itself), or a remote server that scores the
student's completions over HTTP (`kiln.train.remote_teacher`; on_policy only, since it writes nothing),
and may see a different prompt: self-
distillation gives the teacher privileged context in its system message (an instruction to be concise, or
the reference answer) and the student the prompt without it; the completion tokens are the same, so
position i of the completion is scored by both.

Objective, per action token, over the teacher's top-K token ids S (K = 16 or 32) plus one bucket R for
every other token (its mass is one minus the mass on S, for either model):
  KL = sum_{k in S} p_s(k) (log p_s(k) - log p_t(k)) + p_s(R) (log p_s(R) - log p_t(R))
the reverse KL between the two distributions coarsened to K + 1 outcomes. Why this and not the student
renormalised over S: S is all a top-K teacher gives (a remote server's top-K, the on-disk cache), and
both choices are proper divergences there (>= 0, zero when the student matches the teacher on S), but
renormalising leaves the student's mass outside S free: on the tiny test model (675 tokens, flat
distributions) it matched the teacher's odds within S while its greedy answer came from outside S. The
tail bucket pulls that mass to the teacher's, so argmax agrees too; it needs only the teacher's
unnormalised top-K log-probs, which every top-K source returns. `student_topk_mass` (the student's mass
on S) is reported per step. The step loss is the mean over the step's action tokens, so the loss is the
KL to the teacher; `evaluate` reports it before (the starting adapter) and after training.

`objective` picks the divergence on the same K + 1 outcomes (`topk_divergence`): reverse_kl above (the
default on-policy), forward_kl KL(t || s) (the default off-policy) or jsd. Reverse KL's gradient on a
token's logit is scaled by the student's own mass there, so on the teacher's text a token the teacher
favours and the student all but excludes (a fact new to the student) barely moves: on SmolLM2 the student
took the fact teacher's answer form but not the fact. Forward KL is a cross-entropy to the teacher's
distribution, its gradient p_s - p_t, and pulls that token up. Whatever the objective, `kl_to_teacher`
(per step, and before / after in `evaluate`) is the reverse KL, so runs compare on one measure.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model.lora import LoraDelta
from kiln.store.atomic import atomic_write_bytes
from kiln.train.batch import collate
from kiln.train.forward import final_hidden
from kiln.train.loop import Cancelled
from kiln.train.masks import MaskedSequence
from kiln.train.remote_teacher import RemoteTeacher
from kiln.train.trainable_lora import TrainableLora


@dataclass
class DistillItem:
    prompt_ids: list[int]                    # what the student sees
    teacher_prompt_ids: list[int]            # what the teacher sees (the same, or with privileged context)
    label: str
    sample: int = 0                          # index of this sample of its prompt
    completion: list[int] = field(default_factory=list)   # set by `prepare`
    top_ids: Tensor | None = None            # [len(completion), K] the teacher's top-K token ids
    top_logp: Tensor | None = None           # [len(completion), K] the teacher's log-probs of them

    def sequence(self) -> MaskedSequence:
        ids = self.prompt_ids + self.completion
        return MaskedSequence(ids, [False] * len(self.prompt_ids) + [True] * len(self.completion))


@dataclass
class Teacher:
    """Which factors the teacher wears: `factors` (a stored adapter's modules), None with `start` False
    (the bare base), or `start` (the job's starting factors: self-distillation)."""

    identity: dict[str, Any]
    factors: dict[Any, Any] | None = None
    rank: int = 0
    alpha: float = 0.0
    modules: list[str] = field(default_factory=list)
    start: bool = False
    remote: RemoteTeacher | None = None   # a remote teacher scores completions over HTTP; nothing runs here

    def delta(self, model: torch.nn.Module, start: LoraDelta) -> LoraDelta | None:
        if self.start:
            return start
        if self.factors is None:
            return None
        lora = TrainableLora(model.config, self.rank, self.alpha, self.modules,
                             device=next(model.parameters()).device)
        lora.load_factors(self.factors)
        lora.requires_grad_(False)
        return lora


@torch.no_grad()
def generate(model: torch.nn.Module, lora: LoraDelta | None, prompt_ids: list[int], *, max_new_tokens: int,
             stop_ids: set[int], temperature: float, generator: torch.Generator | None) -> list[int]:
    """A completion of `prompt_ids`, up to and including a stop token. Each token re-runs the training
    forward over the whole sequence (no KV cache): slower than the serving engine, but it runs in the
    training thread on exactly the factors being trained, with nothing loaded into the serving bank."""
    device = next(model.parameters()).device
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        hidden = final_hidden(model, torch.tensor([ids], device=device), None, lora)[0, -1:]
        logits = model.compute_logits(hidden)[0].float()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, -1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        ids.append(token)
        if token in stop_ids:
            break
    return out


def _action_logp(model: torch.nn.Module, lora: LoraDelta | None, items: Sequence[DistillItem],
                 teacher_side: bool = False) -> Tensor:
    """Full-vocabulary log-probs at every action token of `items`, `[N, V]`, rows in (item, position) order."""
    seqs = [MaskedSequence(it.teacher_prompt_ids + it.completion,
                           [False] * len(it.teacher_prompt_ids) + [True] * len(it.completion))
            if teacher_side else it.sequence() for it in items]
    batch = collate(seqs, device=next(model.parameters()).device)
    attention = None if bool(batch.attention.all()) else batch.attention
    hidden = final_hidden(model, batch.input_ids, attention, lora)[:, :-1]
    return F.log_softmax(model.compute_logits(hidden[batch.target_mask.bool()]).float(), -1)


def _rest(logp: Tensor) -> Tensor:
    """log of the mass outside the K given log-probabilities, `[N]`."""
    return torch.log((1.0 - logp.exp().sum(-1)).clamp_min(1e-12))


OBJECTIVES = ("reverse_kl", "forward_kl", "jsd")


def topk_kl(student_logp: Tensor, top_ids: Tensor, top_logp: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token reverse KL over the teacher's top-K plus the rest bucket, and the student's mass on the K."""
    gathered = student_logp.gather(-1, top_ids)
    s_rest, t_rest = _rest(gathered), _rest(top_logp)
    kl = (gathered.exp() * (gathered - top_logp)).sum(-1) + s_rest.exp() * (s_rest - t_rest)
    return kl, gathered.exp().sum(-1)


def topk_divergence(objective: str, student_logp: Tensor, top_ids: Tensor, top_logp: Tensor) -> Tensor:
    """Per-token divergence `objective` between the two distributions coarsened to the teacher's top-K plus
    the rest bucket: reverse_kl KL(s || t) (as `topk_kl`), forward_kl KL(t || s), jsd the Jensen-Shannon
    divergence (KL(s || m) + KL(t || m)) / 2 with m the mixture (s + t) / 2."""
    if objective == "reverse_kl":
        return topk_kl(student_logp, top_ids, top_logp)[0]
    gathered = student_logp.gather(-1, top_ids)
    s_rest, t_rest = _rest(gathered), _rest(top_logp)
    if objective == "forward_kl":
        return (top_logp.exp() * (top_logp - gathered)).sum(-1) + t_rest.exp() * (t_rest - s_rest)
    if objective == "jsd":
        s = torch.cat([gathered, s_rest[..., None]], -1)
        t = torch.cat([top_logp, t_rest[..., None]], -1)
        m = torch.logaddexp(s, t) - torch.log(torch.tensor(2.0, device=s.device))
        return 0.5 * ((s.exp() * (s - m)).sum(-1) + (t.exp() * (t - m)).sum(-1))
    raise ValueError(f"unknown OPD objective {objective!r}")


class TeacherCache:
    """Teacher top-K log-probs on disk, keyed by the teacher's identity and a hash of the scored prefix
    (teacher prompt + completion ids) and K; written atomically."""

    def __init__(self, root: str | Path, identity: dict[str, Any]) -> None:
        self.root = Path(root)
        self.identity = repr(sorted(identity.items()))

    def _path(self, ids: list[int], k: int) -> Path:
        h = hashlib.sha256(f"{self.identity}|{k}|{ids}".encode()).hexdigest()
        return self.root / h[:2] / f"{h}.pt"

    def get(self, ids: list[int], k: int) -> tuple[Tensor, Tensor] | None:
        path = self._path(ids, k)
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, weights_only=True)
            return saved["ids"], saved["logp"]
        except Exception:  # a damaged entry is recomputed and rewritten
            return None

    def put(self, ids: list[int], k: int, top_ids: Tensor, top_logp: Tensor) -> None:
        buf = io.BytesIO()
        torch.save({"ids": top_ids.cpu(), "logp": top_logp.cpu()}, buf)
        path = self._path(ids, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())


@dataclass
class OpdWork:
    """The loop's view of an OPD or self-distillation job: items are completions; the loss is the
    token-mean top-K reverse KL to the teacher."""

    items_: list[DistillItem]
    teacher: Teacher
    mode: str                            # on_policy | off_policy
    top_k: int
    max_new_tokens: int
    temperature: float
    seed: int
    stop_ids: set[int]
    cache: TeacherCache | None = None
    objective: str = "reverse_kl"        # the loss: reverse_kl | forward_kl | jsd (see topk_divergence)
    kl_before: float | None = None
    objective_before: float | None = None
    cache_hits: int = 0

    @property
    def items(self) -> list[DistillItem]:
        return self.items_

    @staticmethod
    def tokens(item: DistillItem) -> int:
        return len(item.completion)

    @torch.no_grad()
    def prepare(self, model: torch.nn.Module, lora: LoraDelta, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Completions (by the student's starting factors, or the teacher's), the teacher's top-K at each of
        their tokens, and the starting KL."""
        teacher = self.teacher.delta(model, lora)
        self.cache_hits = 0
        for i, item in enumerate(self.items_):
            if should_stop():
                raise Cancelled()
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i) if self.temperature > 0 else None
            if self.mode == "on_policy":
                item.completion = generate(model, lora, item.prompt_ids, max_new_tokens=self.max_new_tokens,
                                           stop_ids=self.stop_ids, temperature=self.temperature, generator=gen)
            else:
                item.completion = generate(model, teacher, item.teacher_prompt_ids, max_new_tokens=self.max_new_tokens,
                                           stop_ids=self.stop_ids, temperature=self.temperature, generator=gen)
            scored = item.teacher_prompt_ids + item.completion
            hit = self.cache.get(scored, self.top_k) if self.cache is not None else None
            if hit is not None and hit[0].shape == (len(item.completion), self.top_k):
                item.top_ids, item.top_logp = hit
                self.cache_hits += 1
            elif self.teacher.remote is not None:
                item.top_ids, item.top_logp = self.teacher.remote.top_k(
                    scored, len(item.teacher_prompt_ids), self.top_k, model.config.vocab_size)
                if self.cache is not None:
                    self.cache.put(scored, self.top_k, item.top_ids, item.top_logp)
            else:
                top = _action_logp(model, teacher, [item], teacher_side=True).topk(self.top_k, -1)
                item.top_ids, item.top_logp = top.indices.cpu(), top.values.cpu()
                if self.cache is not None:
                    self.cache.put(scored, self.top_k, item.top_ids, item.top_logp)
        self.kl_before, self.objective_before = self.mean_kl(model, lora)

    def loss(self, model: torch.nn.Module, lora: LoraDelta, items: Sequence[DistillItem], normalizer: int,
             memo: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
        logp = _action_logp(model, lora, items)
        ids = torch.cat([it.top_ids for it in items]).to(logp.device)          # type: ignore[misc]
        top = torch.cat([it.top_logp for it in items]).to(logp.device)        # type: ignore[misc]
        kl, mass = topk_kl(logp, ids, top)
        n = max(normalizer, 1)
        metrics = {"kl_to_teacher": float(kl.detach().sum()) / n, "student_topk_mass": float(mass.detach().sum()) / n}
        if self.objective == "reverse_kl":
            return kl.sum() / n, metrics
        div = topk_divergence(self.objective, logp, ids, top)
        return div.sum() / n, {**metrics, self.objective: float(div.detach().sum()) / n}

    @torch.no_grad()
    def mean_kl(self, model: torch.nn.Module, lora: LoraDelta | None) -> tuple[float, float]:
        """Token means of the reverse KL to the teacher and of the objective (the same for reverse_kl)."""
        total, objective, count = 0.0, 0.0, 0
        device = next(model.parameters()).device
        for item in self.items_:
            logp = _action_logp(model, lora, [item])
            ids, top = item.top_ids.to(device), item.top_logp.to(device)  # type: ignore[union-attr]
            kl, _ = topk_kl(logp, ids, top)
            total += float(kl.sum())
            objective += float(kl.sum() if self.objective == "reverse_kl"
                               else topk_divergence(self.objective, logp, ids, top).sum())
            count += kl.numel()
        return total / max(count, 1), objective / max(count, 1)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, lora: LoraDelta) -> dict[str, Any]:
        """The KL to the teacher over every completion, with the starting adapter and the trained one."""
        lengths = [len(it.completion) for it in self.items_]
        kl_after, objective_after = self.mean_kl(model, lora)
        out = {"scope": "training completions", "completions": len(lengths),
               "mean_completion_tokens": round(sum(lengths) / max(len(lengths), 1), 3),
               "teacher_cache_hits": self.cache_hits, "objective": self.objective,
               "kl_to_teacher_before": round(self.kl_before or 0.0, 6),
               "kl_to_teacher_after": round(kl_after, 6)}
        if self.objective != "reverse_kl":
            out[f"{self.objective}_before"] = round(self.objective_before or 0.0, 6)
            out[f"{self.objective}_after"] = round(objective_after, 6)
        return out
