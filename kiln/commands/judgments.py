"""`kiln judgments create|list|append|delete|render-prompt|compile|validate|export` against a running server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from kiln.commands.client import (
    ServerClient,
    add_list_command,
    add_url_argument,
    path_segment,
    printed_json,
    run_client_command,
    table_console,
)


def register(sub) -> None:
    p = sub.add_parser("judgments", help="collect pairwise judgments and compile them into judge training data")
    cmds = p.add_subparsers(dest="judgments_command", metavar="ACTION", required=True)

    create = cmds.add_parser("create", help="create an empty judgment set")
    create.add_argument("name", help="judgment set name (one path segment)")
    create.add_argument("--description", help="free text shown by `kiln judgments list`")
    create.set_defaults(func=lambda a: run_client_command(_create, a))

    ls = add_list_command(cmds, _list, "list judgment sets")

    append = cmds.add_parser("append", help="append judgments (from flags, or a JSON / JSONL file of bodies)")
    append.add_argument("name", help="judgment set name")
    _judgment_arguments(append)
    append.set_defaults(func=lambda a: run_client_command(_append, a))

    rm = cmds.add_parser("delete", help="delete a judgment set, or one row of it with --row")
    rm.add_argument("name", help="judgment set name")
    rm.add_argument("--row", metavar="ID", help="delete only the judgment with this id")
    rm.set_defaults(func=lambda a: run_client_command(_delete, a))

    render = cmds.add_parser("render-prompt", help="print the exact judge prompt for two replies")
    _judgment_arguments(render)
    render.set_defaults(func=lambda a: run_client_command(_render, a))

    comp = cmds.add_parser("compile", help="compile a judgment set into an sft_chat dataset")
    comp.add_argument("name", help="judgment set name")
    comp.add_argument("--output", required=True, dest="output_dataset", help="name of the dataset to create")
    comp.add_argument("--holdout-n", type=int, help="most recent judgments kept out (default min(20, rows/5))")
    comp.add_argument("--include-skips", action="store_true", help="also consider judgments marked skip")
    comp.set_defaults(func=lambda a: run_client_command(_compile, a))

    val = cmds.add_parser("validate", help="queue a held-out validation eval of a judge adapter")
    val.add_argument("name", help="judgment set name")
    val.add_argument("--adapter", required=True, help="the judge adapter to score (\"\" = the base model)")
    val.add_argument("--holdout-n", type=int, help="how many of the most recent judgments to score (default 20)")
    val.set_defaults(func=lambda a: run_client_command(_validate, a))

    export = cmds.add_parser("export", help="write the A/B judgments as preference JSONL (TRL's or OpenAI's DPO format)")
    export.add_argument("name", help="judgment set name")
    export.add_argument("--format", choices=("trl", "openai"), default="trl",
                        help="trl: {prompt, chosen, rejected} (default); openai: {input, preferred_output, "
                             "non_preferred_output}")
    export.add_argument("--output", "-o", type=Path, help="write to this file (default: stdout)")
    export.set_defaults(func=lambda a: run_client_command(_export, a))

    for parser in (create, ls, append, rm, render, comp, val, export):
        add_url_argument(parser)


def _judgment_arguments(p) -> None:
    p.add_argument("--file", type=Path, help="JSON object, JSON array or JSONL of AppendJudgmentBody")
    p.add_argument("--prompt", help="the user message both replies answer")
    p.add_argument("--system", help="an optional system message before --prompt")
    p.add_argument("--response-a", help="reply A")
    p.add_argument("--response-b", help="reply B")
    p.add_argument("--winner", choices=["a", "b", "tie", "skip"], help="which reply is better")
    p.add_argument("--id", help="row id (default: a UUID assigned by the server)")
    p.add_argument("--adapter-a", help="the adapter that wrote reply A (\"\" or omitted = the base model)")
    p.add_argument("--adapter-b", help="the adapter that wrote reply B")
    p.add_argument("--note", help="why; a compiled row carries it as its Reason: line")
    p.add_argument("--tag", action="append", default=[], dest="tags", help="a tag for the row (repeatable)")



def _bodies(args, *, default_winner: str | None = None) -> list[dict[str, Any]]:
    if args.file:
        text = args.file.read_text("utf-8")
        try:
            whole = json.loads(text)
        except ValueError:  # not one JSON document: JSON lines
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return whole if isinstance(whole, list) else [whole]
    missing = [flag for flag, v in (("--prompt", args.prompt), ("--response-a", args.response_a),
                                    ("--response-b", args.response_b)) if v is None]
    winner = args.winner or default_winner
    if winner is None:
        missing.append("--winner")
    if missing:
        raise SystemExit(f"error: give --file, or {', '.join(missing)}")
    prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    body: dict[str, Any] = {"prompt": prompt, "response_a": args.response_a, "response_b": args.response_b,
                            "winner": winner, "tags": args.tags}
    for key in ("id", "adapter_a", "adapter_b", "note"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    return [body]


def _create(client: ServerClient, args) -> int:
    body = client.post("/v1/judgments", json={"name": args.name, "description": args.description})
    print(f"created {body['name']}")
    return 0


def _list(client: ServerClient, args) -> int:
    body = client.get("/v1/judgments")
    if printed_json(args, body):
        return 0
    table = Table("name", "rows", "a", "b", "tie", "skip", "compiled split", "updated", "description")
    for m in body["judgments"]:
        h = m["winner_histogram"]
        table.add_row(m["name"], str(m["num_rows"]), *(str(h.get(k, 0)) for k in ("a", "b", "tie", "skip")),
                      str(m.get("last_compiled_split", "-")), m["updated_at"], m.get("description") or "")
    table_console().print(table)
    return 0


def _append(client: ServerClient, args) -> int:
    for body in _bodies(args):
        resp = client.post(f"/v1/judgments/{path_segment(args.name)}/rows", json=body)
        print(f"appended {resp['judgment_id']} ({resp['num_rows']} rows)")
    return 0


def _delete(client: ServerClient, args) -> int:
    if args.row:
        resp = client.delete(f"/v1/judgments/{path_segment(args.name)}/rows/{path_segment(args.row)}")
        print(f"deleted row {args.row} ({resp['num_rows']} rows left)")
    else:
        resp = client.delete(f"/v1/judgments/{path_segment(args.name)}")
        print(f"{resp['status']} {resp['name']}")
    return 0


def _render(client: ServerClient, args) -> int:
    # The prompt never shows the verdict; the body type still requires one.
    for body in _bodies(args, default_winner="tie"):
        print(client.post("/v1/judgments/render_prompt", json=body)["prompt"])
    return 0


def _compile(client: ServerClient, args) -> int:
    body: dict[str, Any] = {"output_dataset": args.output_dataset, "include_skips": args.include_skips}
    if args.holdout_n is not None:
        body["holdout_n"] = args.holdout_n
    resp = client.post(f"/v1/judgments/{path_segment(args.name)}/compile", json=body)
    print(f"compiled {resp['rows']} rows into {resp['dataset']['name']} "
          f"(first {resp['train_validation_split']} judgments; last {resp['holdout_n']} held out)")
    for warning in resp["warnings"]:
        print(f"warning: {warning}")
    return 0


def _validate(client: ServerClient, args) -> int:
    body: dict[str, Any] = {"adapter": args.adapter}
    if args.holdout_n is not None:
        body["holdout_n"] = args.holdout_n
    resp = client.post(f"/v1/judgments/{path_segment(args.name)}/validate", json=body)
    judge = args.adapter or "the base model"
    print(f"queued eval job {resp['eval_job_id']} scoring {judge} on suite {resp['validation_suite']} "
          f"(seed {resp['effective_seed']}); follow it with `kiln eval show {resp['eval_job_id']}`")
    for warning in resp["warnings"]:
        print(f"warning: {warning}")
    return 0


def _export(client: ServerClient, args) -> int:
    resp = client.request("GET", f"/v1/judgments/{path_segment(args.name)}/export", params={"format": args.format})
    if args.output is None:
        sys.stdout.write(resp.text)
    else:
        args.output.write_bytes(resp.content)
    print(f"{resp.headers.get('x-kiln-pairs', '?')} pairs ({resp.headers.get('x-kiln-ties-left-out', '?')} tie and "
          f"{resp.headers.get('x-kiln-skips-left-out', '?')} skip judgments left out)", file=sys.stderr)
    return 0
