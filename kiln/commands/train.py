"""`kiln train sft|grpo|dpo|opd|status|queue|cancel`: submit training jobs to the server at --url and follow them.

`sft FILE` reads a local JSONL file of conversations and sends it inline; `--dataset NAME` trains on an
uploaded dataset split; `--server-path PATH` names a JSONL file on the server's own disk. `grpo` takes
the same sources with rows of {messages, completions: [{text, reward}]}; `dpo` takes preference rows
({messages, chosen, rejected}, TRL's {prompt, chosen, rejected} or OpenAI's DPO rows) or `--judgments
NAME`, a judgment set whose A/B rows become the pairs; `opd --teacher ALIAS` takes prompt rows (a string,
{messages} or {prompt}) and distills the registered teacher into the student. Submitting follows the job
with a progress bar and the loss until it ends (Ctrl-C cancels it); `status --follow` does the same
for a job already running. `--post-eval-suite` adds a post-training eval (semantics.md §8.14): following
then waits while its gate is pending and prints the outcome and verdict (train_follow.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.table import Table

from kiln.commands.client import (
    ServerClient,
    ServerError,
    add_url_argument,
    printed_json,
    run_client_command,
    table_console,
)
from kiln.commands.train_follow import EXIT_HELP, TERMINAL, follow, report


def register(sub) -> None:
    p = sub.add_parser("train", help="train LoRA adapters on the server (SFT, GRPO, DPO, OPD) and follow the jobs")
    cmds = p.add_subparsers(dest="train_command", metavar="ACTION", required=True)

    sft = cmds.add_parser("sft", help="supervised fine-tuning on chat conversations", epilog=EXIT_HELP)
    _source_args(sft, "JSONL of {\"messages\": [...]} conversations")
    _common_args(sft)
    sft.set_defaults(func=lambda a: run_client_command(_submit_sft, a))

    grpo = cmds.add_parser("grpo", help="GRPO on groups of scored completions", epilog=EXIT_HELP)
    _source_args(grpo, "JSONL of {\"messages\": [...], \"completions\": [{\"text\", \"reward\"}]} groups")
    _common_args(grpo)
    grpo.add_argument("--kl-coeff", type=float, help="KL penalty coefficient (default 0.1)")
    grpo.add_argument("--clip-epsilon", type=float, help="ratio clip epsilon (default 0.2)")
    grpo.add_argument("--kl-estimator", choices=("k3", "k1", "none"), help="KL estimator against the frozen policy (default k3)")
    grpo.add_argument("--reward-scorer", metavar="JSON",
                      help='score completions with an eval scorer, e.g. \'{"kind": "exact_match"}\'')
    grpo.add_argument("--target", help="with --reward-scorer: the target for groups without their own")
    grpo.set_defaults(func=lambda a: run_client_command(_submit_grpo, a))

    dpo = cmds.add_parser("dpo", help="DPO on preference pairs or a judgment set's A/B judgments", epilog=EXIT_HELP)
    _source_args(dpo, "JSONL of {\"messages\", \"chosen\", \"rejected\"} pairs (or TRL / OpenAI preference rows)")
    dpo.add_argument("--judgments", metavar="NAME",
                     help="train on this judgment set instead (A/B rows; tie and skip rows are left out)")
    _common_args(dpo)
    dpo.add_argument("--beta", type=float, help="strength of the pull toward the starting model (default 0.1)")
    dpo.add_argument("--loss-type", choices=("sigmoid", "ipo"), help="DPO's sigmoid loss (default) or IPO")
    dpo.add_argument("--heldout-percent", type=int,
                     help="share of the prompts held out to score the adapter against its start (default 10)")
    dpo.add_argument("--min-heldout-win-rate", type=float, metavar="F",
                     help="do not load the new adapter unless it beats its start on at least F of the held-out pairs")
    dpo.set_defaults(func=lambda a: run_client_command(_submit_dpo, a))

    opd = cmds.add_parser("opd", help="distill a registered teacher into the student (a KL over its top-K)",
                          epilog=EXIT_HELP)
    _source_args(opd, "JSONL of prompts: strings, {\"messages\": [...]} or {\"prompt\": ...}")
    opd.add_argument("--teacher", required=True, help="a registered teacher's alias (kiln teachers list)")
    opd.add_argument("--mode", dest="training_mode", choices=("on_policy", "off_policy"),
                     help="who writes the completions: the student (default) or the teacher")
    opd.add_argument("--objective", choices=("reverse_kl", "forward_kl", "jsd"),
                     help="the divergence to the teacher the loss minimises (default: reverse_kl on_policy, "
                          "forward_kl off_policy)")
    _distill_args(opd)
    _common_args(opd)
    opd.set_defaults(func=lambda a: run_client_command(_submit_opd, a))

    status = cmds.add_parser("status", help="list training jobs, or show / follow one", epilog="with --follow, " + EXIT_HELP)
    status.add_argument("job_id", nargs="?", help="a job id (default: all jobs; with --follow the running one)")
    status.add_argument("--follow", "-f", action="store_true",
                        help="follow the job with a progress bar until it ends and its post-training gate decides")
    _require_pass_arg(status)
    status.add_argument("--json", action="store_true", help="print the raw JSON response")
    add_url_argument(status)
    status.set_defaults(func=lambda a: run_client_command(_status, a))

    queue = cmds.add_parser("queue", help="show the running and queued jobs")
    queue.add_argument("--json", action="store_true", help="print the raw JSON response")
    add_url_argument(queue)
    queue.set_defaults(func=lambda a: run_client_command(_queue, a))

    cancel = cmds.add_parser("cancel", help="cancel a queued job, or stop a running one at its next step")
    cancel.add_argument("job_id", help="a training job id (train-...)")
    add_url_argument(cancel)
    cancel.set_defaults(func=lambda a: run_client_command(_cancel, a))


def _distill_args(p) -> None:
    p.add_argument("--top-k", type=int, choices=(16, 32), help="the teacher's top-K tokens the KL runs over (default 16)")
    p.add_argument("--samples-per-prompt", type=int, help="completions per prompt (default 1)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per completion at most (default 64)")
    p.add_argument("--temperature", type=float, help="0 (default) writes greedily; above 0 samples, seeded by --seed")


def _source_args(p, what: str) -> None:
    p.add_argument("file", nargs="?", type=Path, metavar="FILE", help=f"local {what}, sent inline")
    p.add_argument("--dataset", help="train on this uploaded dataset instead")
    p.add_argument("--split", help="dataset split (default train)")
    p.add_argument("--server-path", help="train on this absolute JSONL path on the server's disk instead")


def _common_args(p) -> None:
    p.add_argument("--output", "-o", dest="output_name", help="adapter name to create (default: generated)")
    p.add_argument("--base-adapter", help="continue training this adapter")
    p.add_argument("--overwrite", action="store_true", help="replace an existing adapter named --output")
    p.add_argument("--rank", dest="lora_rank", type=int, help="LoRA rank (default 16)")
    p.add_argument("--alpha", dest="lora_alpha", type=float, help="LoRA alpha; the delta is scaled by alpha/rank (default 32)")
    p.add_argument("--target-modules", help="comma-separated projections (default: all attention and MLP)")
    p.add_argument("--lr", dest="learning_rate", type=float,
                   help="learning rate (default 2e-4 for SFT, 1e-5 for GRPO, 5e-5 for DPO)")
    p.add_argument("--epochs", type=int, help="passes over the data (default 3 for SFT and DPO, 1 for GRPO)")
    p.add_argument("--batch-size", type=int, help="rows per optimizer step (default 1)")
    p.add_argument("--grad-accum", dest="gradient_accumulation_steps", type=int,
                   help="batches accumulated per optimizer step (default 1)")
    p.add_argument("--max-seq-len", type=int, help="longer rows are truncated to this many tokens (default 2048)")
    p.add_argument("--seed", type=int, help="seed for initialisation and shuffling (default 0)")
    p.add_argument("--no-auto-load", action="store_true", help="do not make the new adapter the server default")
    p.add_argument("--webhook-url", help="POST the job's terminal state here")
    p.add_argument("--no-follow", action="store_true", help="submit and print the job id without waiting")
    p.add_argument("--json", action="store_true", help="print the final job detail as JSON")
    _require_pass_arg(p)
    _post_eval_args(p)
    add_url_argument(p)


def _require_pass_arg(p) -> None:
    p.add_argument("--require-pass", action="store_true",
                   help="exit 3 when the post-training gate decides regression, demoted or inconclusive")


def _post_eval_args(p) -> None:
    g = p.add_argument_group("post-training eval (the `post_eval` block)")
    g.add_argument("--post-eval-suite", metavar="NAME",
                   help="after training, run this registered eval suite on the new adapter (and the baseline)")
    g.add_argument("--data-scope", choices=("held-out", "train-set-eval"),
                   help="held-out (default): suite disjoint from the training rows, gates activation; "
                        "train-set-eval: measures the training data, report only")
    g.add_argument("--min-accuracy", type=float, metavar="F",
                   help="gate: accuracy floor - demoted when surely below F, inconclusive when not surely above "
                        "(Wilson bounds; default 0)")
    g.add_argument("--relative-recovery", type=float, metavar="F",
                   help="gate: pass only if candidate accuracy (lower bound) / baseline (upper bound) reaches F")
    g.add_argument("--absolute-gain", type=float, metavar="F",
                   help="gate: pass only if candidate accuracy (lower bound) - baseline (upper bound) reaches F")
    g.add_argument("--include-baseline", action="store_true",
                   help="also evaluate the baseline in a train-set-eval (a gated eval always does)")
    g.add_argument("--no-auto-load-on-pass", action="store_true",
                   help="leave a passing adapter on disk, not the server default (outcome \"kept\")")
    g.add_argument("--post-eval-generation", metavar="JSON",
                   help='generation override for the eval, e.g. \'{"max_tokens": 64}\'')


_CONFIG_KEYS = ("output_name", "base_adapter", "overwrite", "lora_rank", "lora_alpha", "learning_rate", "epochs",
                "batch_size", "gradient_accumulation_steps", "max_seq_len", "seed", "webhook_url")


def read_jsonl(path: Path) -> list[Any]:
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ServerError(0, f"{path} line {lineno} is not valid JSON: {e}") from None
    return rows


def build_body(args, inline_key: str) -> dict[str, Any]:
    judgments = getattr(args, "judgments", None)
    sources = [s for s in (args.file, args.dataset, args.server_path, judgments) if s is not None]
    if len(sources) != 1:
        raise ServerError(0, "give exactly one of FILE, --dataset or --server-path"
                          + (" or --judgments" if hasattr(args, "judgments") else ""))
    body: dict[str, Any] = {}
    if judgments is not None:
        body["judgments"] = judgments
    elif args.file is not None:
        body[inline_key] = read_jsonl(args.file)
    elif args.dataset is not None:
        body["dataset"] = args.dataset
        if args.split:
            body["dataset_split"] = args.split
    else:
        body["dataset_path"] = args.server_path
    config = {k: getattr(args, k) for k in _CONFIG_KEYS if getattr(args, k, None) not in (None, False)}
    if args.target_modules:
        config["target_modules"] = [m.strip() for m in args.target_modules.split(",") if m.strip()]
    if args.no_auto_load:
        config["auto_load"] = False
    for key in ("kl_coeff", "clip_epsilon", "kl_estimator", "beta", "loss_type", "heldout_percent",
                "min_heldout_win_rate", "training_mode", "objective", "top_k", "samples_per_prompt", "max_new_tokens",
                "temperature"):
        if getattr(args, key, None) is not None:
            config[key] = getattr(args, key)
    body["config"] = config
    if getattr(args, "reward_scorer", None):
        try:
            scorer = json.loads(args.reward_scorer)
        except ValueError as e:
            raise ServerError(0, f"--reward-scorer is not valid JSON: {e}") from None
        body["reward_scorer"] = {"scorer": scorer, **({"target": args.target} if args.target else {})}
    post_eval = build_post_eval(args)
    if post_eval is not None:
        body["post_eval"] = post_eval
    return body


_POST_EVAL_VALUES = ("data_scope", "min_accuracy", "relative_recovery", "absolute_gain")  # flag dest == field


def build_post_eval(args) -> dict[str, Any] | None:
    """The request's `post_eval` block from the --post-eval-* and gate flags; None without a suite."""
    given = [k for k in _POST_EVAL_VALUES if getattr(args, k, None) is not None]
    given += [k for k in ("include_baseline", "no_auto_load_on_pass", "post_eval_generation") if getattr(args, k, None)]
    suite = getattr(args, "post_eval_suite", None)
    if suite is None:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ServerError(0, f"{flags} need(s) --post-eval-suite NAME")
        return None
    block: dict[str, Any] = {"suite": suite}
    block.update({k: getattr(args, k) for k in _POST_EVAL_VALUES if getattr(args, k) is not None})
    if args.include_baseline:
        block["include_baseline"] = True
    if args.no_auto_load_on_pass:
        block["auto_load_on_pass"] = False
    if args.post_eval_generation:
        try:
            block["generation"] = json.loads(args.post_eval_generation)
        except ValueError as e:
            raise ServerError(0, f"--post-eval-generation is not valid JSON: {e}") from None
    return block


def _submit_sft(client: ServerClient, args) -> int:
    return _submit(client, args, "/v1/train/sft", build_body(args, "examples"))


def _submit_grpo(client: ServerClient, args) -> int:
    return _submit(client, args, "/v1/train/grpo", build_body(args, "groups"))


def _submit_dpo(client: ServerClient, args) -> int:
    return _submit(client, args, "/v1/train/dpo", build_body(args, "pairs"))


def _submit_opd(client: ServerClient, args) -> int:
    return _submit(client, args, "/v1/train/opd", {**build_body(args, "prompts"), "teacher": args.teacher})


def _submit(client: ServerClient, args, path: str, body: dict[str, Any]) -> int:
    receipt = client.post(path, json=body)
    print(receipt["message"], file=sys.stderr)
    if args.no_follow:
        print(receipt["job_id"])
        return 0
    return report(follow(client, receipt["job_id"]), as_json=args.json, client=client, require_pass=args.require_pass)


def _status(client: ServerClient, args) -> int:
    if args.follow:
        job_id = args.job_id or (client.get("/v1/train/queue").get("running") or {}).get("job_id")
        if not job_id:
            print("no training job is running", file=sys.stderr)
            return 1
        return report(follow(client, job_id), as_json=args.json, client=client, require_pass=args.require_pass)
    if args.job_id:
        status = client.get(f"/v1/train/status/{quote(args.job_id, safe='')}")
        print(json.dumps(status, indent=2))
        return 0
    jobs = client.get("/v1/train/status")
    if printed_json(args, jobs):
        return 0
    table = Table("job", "type", "state", "progress", "loss", "adapter", "gate", "submitted")
    for j in jobs:
        loss = j.get("current_loss")
        table.add_row(j["job_id"], j["job_type"], j["state"], f"{100 * j['progress']:.0f}%",
                      "-" if loss is None else f"{loss:.4f}", j["adapter_name"], j.get("gate_outcome") or "-",
                      j["submitted_at"])
    table_console().print(table)
    return 0


def _queue(client: ServerClient, args) -> int:
    view = client.get("/v1/train/queue")
    if printed_json(args, view):
        return 0
    running = view.get("running")
    print(f"running: {running['job_id']} ({running['adapter_name']}, {100 * running['progress']:.0f}%)"
          if running else "running: none")
    for q in view["queued"]:
        print(f"  {q['position']}. {q['job_id']} {q['job_type']} -> {q['adapter_name']}")
    return 0


def _cancel(client: ServerClient, args) -> int:
    job = quote(args.job_id, safe="")
    state = client.get(f"/v1/train/status/{job}")["state"]
    if state in TERMINAL:  # DELETE on a finished job would forget it; cancel never does that
        print(f"{args.job_id} already ended ({state})", file=sys.stderr)
        return 1
    print(json.dumps(client.delete(f"/v1/train/jobs/{job}")))
    return 0
