"""Planning OPD (POST /v1/train/opd) and self-distillation (POST /v1/distill/self) jobs: prompts read and
tokenized, the teacher resolved, every client mistake a 4xx before anything runs.

Prompt rows: a string (one user turn), `{"messages": [...]}` (a trailing assistant turn is the row's
reference answer, not part of the prompt) or `{"prompt": str | messages}`; any row may carry
`"reference"`. Self-distillation's teacher is the starting point itself (base + config.base_adapter)
with privileged context prepended to its system message: `conciseness` an instruction to be brief,
`ground_truth_conditioning` the row's reference answer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError
from kiln.train.errors import invalid, row_invalid
from kiln.train.opd import DistillItem, OpdWork, Teacher, TeacherCache
from kiln.train.plan import TrainingPlan, _plan
from kiln.train.post_eval import plan_post_eval
from kiln.train.remote_teacher import RemoteTeacher
from kiln.train.requests import DistillConfig, OpdRequest, SelfDistillRequest
from kiln.train.sources import TrainingData, resolve_source

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

CONCISE = "Answer as briefly as possible: one short sentence, no preamble, no explanation."
GROUND_TRUTH = ("The correct answer is: {reference}\nAnswer the user with it, in your own words, "
                "without mentioning that you were given it.")


def prompt_of(row: Any, label: str) -> tuple[list[dict[str, Any]], str | None]:
    """(prompt messages, reference answer or None) of one prompt row; a 400 naming the row otherwise."""
    reference = None
    if isinstance(row, str):
        messages: Any = [{"role": "user", "content": row}]
    elif isinstance(row, dict) and ("messages" in row or "prompt" in row):
        messages = row.get("messages", row.get("prompt"))
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        reference = row.get("reference")
    else:
        raise row_invalid(label, "must be a string, {messages} or {prompt}")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise row_invalid(label, "messages must be a non-empty list of {role, content} with string content",
                          field="messages")
    if messages[-1]["role"] == "assistant":
        reference = reference if reference is not None else messages[-1]["content"]
        messages = messages[:-1]
    if not messages or not any(m["role"] == "user" for m in messages):
        raise row_invalid(label, "the prompt needs a user message", field="messages")
    if reference is not None and not isinstance(reference, str):
        raise row_invalid(label, "reference must be a string", field="reference")
    return [{"role": m["role"], "content": m["content"]} for m in messages], reference


def with_context(messages: list[dict[str, Any]], context: str) -> list[dict[str, Any]]:
    """The prompt with privileged `context` leading its system message (one is added when absent)."""
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{context}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": context}, *messages]


def _encode(engine: EngineView, messages: list[dict[str, Any]], label: str) -> list[int]:
    try:
        text = engine.template.render(messages, add_generation_prompt=True)
    except ValueError as e:
        raise row_invalid(label, f"the chat template rejected the messages: {getattr(e, 'message', e)}",
                          field="messages") from None
    return list(engine.tokenizer.backend.encode(text, add_special_tokens=False).ids)


def _items(engine: EngineView, cfg: DistillConfig, data: TrainingData,
           teacher_context: Any) -> list[DistillItem]:
    """One item per (prompt, sample); `teacher_context(messages, reference, label)` gives the teacher's prompt."""
    items = []
    for row, label in zip(data.rows, data.labels, strict=True):
        messages, reference = prompt_of(row, label)
        student = _encode(engine, messages, label)
        teacher_messages = teacher_context(messages, reference, label)
        teacher = student if teacher_messages is messages else _encode(engine, teacher_messages, label)
        longest = max(len(student), len(teacher))
        if longest + 1 > cfg.max_seq_len:
            raise row_invalid(label, f"the prompt is {longest} tokens, leaving no room for a completion within "
                                     f"max_seq_len ({cfg.max_seq_len})", field="messages",
                              hint="Raise config.max_seq_len or shorten the prompt.")
        for s in range(cfg.samples_per_prompt):
            items.append(DistillItem(student, teacher, label, s))
    return items


def _work(engine: EngineView, cfg: DistillConfig, items: list[DistillItem], teacher: Teacher, mode: str,
          cache_root: Path | None, objective: str = "reverse_kl") -> OpdWork:
    longest = max(max(len(i.prompt_ids), len(i.teacher_prompt_ids)) for i in items)
    max_new = min(cfg.max_new_tokens, cfg.max_seq_len - longest)
    stop = set(engine.tokenizer.eos_token_ids or [])
    cache = TeacherCache(cache_root, teacher.identity) if cache_root is not None else None
    return OpdWork(items, teacher, mode, cfg.top_k, max_new, cfg.temperature, cfg.seed, stop, cache, objective)


def _prompt_rows(data: TrainingData) -> TrainingData:
    """The rows as conversations (the reference as the assistant turn), for the post-eval overlap check."""
    rows = []
    for row, label in zip(data.rows, data.labels, strict=True):
        messages, reference = prompt_of(row, label)
        tail = [{"role": "assistant", "content": reference}] if reference is not None else []
        rows.append({"messages": [*messages, *tail]})
    return TrainingData(rows, data.labels, data.source)


def _stats(work: OpdWork, data: TrainingData) -> dict[str, Any]:
    return {"prompts": len(data.rows), "completions": len(work.items), "top_k": work.top_k,
            "max_new_tokens": work.max_new_tokens, "mode": work.mode, "objective": work.objective}


def resolve_teacher(alias: str, teachers: Any, engine: EngineView, adapters: Any) -> Teacher:
    """A registered teacher: a local one still what it was when registered (409 changed), or a remote one
    (its key's environment variable set); 400 unknown."""
    if teachers is None:
        raise KilnError(503, "teacher_registry_unavailable", "the teacher registry is not available", param="teacher")
    try:
        record = teachers.get(alias)
    except KilnError:
        raise invalid(f"teacher {alias!r} is not registered", param="teacher",
                      hint="GET /v1/teachers lists the teachers; POST /v1/teachers registers one.") from None
    identity = dict(record.get("identity") or {})
    if record.get("kind") == "remote":
        return _remote(alias, record, identity)
    mine = engine.identity.base_model_sha256 if engine.identity is not None else None
    if identity.get("base_model_sha256") and mine and identity["base_model_sha256"] != mine:
        raise KilnError(409, "teacher_changed", f"teacher {alias!r} was registered on other base weights "
                        "than this server serves", param="teacher", hint="Register the teacher again on this model.")
    adapter = record.get("adapter")
    if adapter is None:
        return Teacher({"alias": alias, **identity})
    if not adapters.exists(adapter):
        raise KilnError(409, "teacher_changed", f"teacher {alias!r} wears adapter {adapter!r}, which no longer "
                        "exists", param="teacher", hint="Register the teacher again.")
    loaded = adapters.load_adapter(adapter)
    if identity.get("adapter_content_sha256") not in (None, loaded.content_sha256):
        raise KilnError(409, "teacher_changed", f"teacher {alias!r}'s adapter {adapter!r} changed since it was "
                        "registered", param="teacher", hint="Register it again under a new alias.")
    ranks = {m.a.shape[0] for m in loaded.modules.values()}
    scales = {round(m.scale, 9) for m in loaded.modules.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise invalid(f"teacher {alias!r}'s adapter mixes ranks or scales; a uniform adapter is needed",
                      param="teacher")
    rank = ranks.pop()
    modules = sorted({mod for _, mod in loaded.modules})
    return Teacher({"alias": alias, **identity}, dict(loaded.modules), rank, scales.pop() * rank, modules)


def _remote(alias: str, record: dict[str, Any], identity: dict[str, Any]) -> Teacher:
    env = record.get("api_key_env")
    if env is not None and not os.environ.get(env):
        raise invalid(f"teacher {alias!r} needs environment variable {env}, which is not set on this server",
                      param="teacher", hint="Set it where the server starts.")
    remote = RemoteTeacher(alias, record["url"], identity.get("model_id") or record.get("model_id"), env)
    return Teacher({"alias": alias, **identity}, remote=remote)


def plan_opd(req: OpdRequest, engine: EngineView, adapters: Any, datasets: Any, suites: Any = None, *,
             job_id: str | None = None, teachers: Any = None) -> TrainingPlan:
    """Teacher log-probs are cached beside the registry, `<data_dir>/teachers/logprob_cache/`."""
    cfg = req.config
    data = resolve_source("opd", req.prompts, req.dataset, req.dataset_split, req.dataset_path, datasets)
    teacher = resolve_teacher(req.teacher, teachers, engine, adapters)
    if teacher.remote is not None and cfg.training_mode != "on_policy":
        raise invalid(f"teacher {req.teacher!r} is remote: it scores the student's completions but writes none, "
                      "so training_mode must be on_policy", param="config.training_mode",
                      hint="Use training_mode on_policy, or a local teacher for off_policy.")
    items = _items(engine, cfg, data, lambda messages, reference, label: messages)
    post_eval = plan_post_eval(req.post_eval, cfg, _prompt_rows(data), suites, adapters)
    cache_root = Path(teachers.path).parent / "logprob_cache" if getattr(teachers, "path", None) else None
    work = _work(engine, cfg, items, teacher, cfg.training_mode, cache_root, cfg.objective or "reverse_kl")
    stats = {**_stats(work, data), "teacher": req.teacher}
    return _plan("opd", cfg, work, data, adapters, stats, post_eval=post_eval, job_id=job_id)


def plan_self_distill(req: SelfDistillRequest, engine: EngineView, adapters: Any, datasets: Any, suites: Any = None, *,
                      job_id: str | None = None) -> TrainingPlan:
    cfg = req.config
    data = resolve_source("distill", req.prompts, req.dataset, req.dataset_split, req.dataset_path, datasets)

    def context(messages: list[dict[str, Any]], reference: str | None, label: str) -> list[dict[str, Any]]:
        if req.mode == "conciseness":
            return with_context(messages, req.instruction or CONCISE)
        if reference is None:
            raise row_invalid(label, "ground_truth_conditioning needs the row's reference answer",
                              field="reference", hint="Give `reference`, or end `messages` with the assistant's answer.")
        template = req.instruction or GROUND_TRUTH
        return with_context(messages, template.replace("{reference}", reference))

    items = _items(engine, cfg, data, context)
    post_eval = plan_post_eval(req.post_eval, cfg, _prompt_rows(data), suites, adapters)
    start = {"base_adapter": cfg.base_adapter, "mode": req.mode, "instruction": req.instruction}
    work = _work(engine, cfg, items, Teacher(start, start=True), "off_policy", None)
    stats = {**_stats(work, data), "self_distill_mode": req.mode}
    return _plan("distill", cfg, work, data, adapters, stats, post_eval=post_eval, job_id=job_id)
