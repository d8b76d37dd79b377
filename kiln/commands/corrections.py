"""`kiln corrections add|list|show|delete|train|export` against a running server."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.table import Table

from kiln.commands.client import (
    ServerClient,
    ServerError,
    add_url_argument,
    path_segment,
    run_client_command,
    table_console,
)
from kiln.commands.train_follow import follow, report


def register(sub) -> None:
    p = sub.add_parser("corrections", help="correct served answers and train the corrections into an adapter")
    cmds = p.add_subparsers(dest="corrections_command", metavar="ACTION", required=True)

    add = cmds.add_parser(
        "add", help="record what a served answer should have been",
        description="Correct a served completion by its id (chatcmpl-..., as GET /v1/stats/recent-requests shows "
        "it), or give the conversation with --prompt (and --system) or --messages FILE.")
    add.add_argument("request_id", nargs="?", help="the served completion's id (chatcmpl-...)")
    add.add_argument("-c", "--corrected", required=True, help="the answer it should have given")
    add.add_argument("--prompt", help="instead of an id: the user message that was answered")
    add.add_argument("--system", help="a system message before --prompt")
    add.add_argument("--messages", help="instead of an id: a JSON file holding the conversation")
    add.add_argument("--prompt-index", type=int, help="which prompt of a batch request")
    add.add_argument("--note", help="free text kept with the correction")
    add.set_defaults(func=lambda a: run_client_command(_add, a))

    ls = cmds.add_parser("list", help="list corrections, newest first")
    ls.add_argument("--state", choices=["pending", "trained", "all"], default="all", help="which corrections (default all)")
    ls.add_argument("--json", action="store_true", help="print the raw JSON response")
    ls.set_defaults(func=lambda a: run_client_command(_list, a))

    show = cmds.add_parser("show", help="print one correction as JSON")
    show.add_argument("correction_id", help="a correction id (corr-...)")
    show.set_defaults(func=lambda a: run_client_command(_show, a))

    rm = cmds.add_parser("delete", help="delete a correction")
    rm.add_argument("correction_id", help="a correction id (corr-...)")
    rm.set_defaults(func=lambda a: run_client_command(_delete, a))

    train = cmds.add_parser(
        "train", help="train the pending corrections into an adapter and follow the job",
        description="Queue an SFT job on the pending corrections (the server fills a recipe that makes a few "
        "facts stick: many epochs at a high LoRA rate; by default it continues the active adapter and "
        "activates the result). Exit status: 0 when the job completed, 1 when it failed or was cancelled.")
    train.add_argument("-o", "--output-name", help="the adapter to write (default corrections-<timestamp>)")
    train.add_argument("--config", help="more SFT config as a JSON object, e.g. '{\"epochs\": 20}'")
    train.add_argument("--from-base", action="store_true", help="start from the base model, not the active adapter")
    train.add_argument("--no-auto-load", action="store_true", help="do not make the new adapter the default")
    train.add_argument("--no-follow", action="store_true", help="print the job id and return")
    train.add_argument("--json", action="store_true", help="print the final job detail as JSON")
    train.set_defaults(func=lambda a: run_client_command(_train, a))

    ex = cmds.add_parser("export", help="write the corrections as sft_chat rows, or as a server dataset")
    ex.add_argument("-o", "--output", help="a local JSONL file ('-' for stdout)")
    ex.add_argument("--dataset", help="instead: create this dataset on the server")
    ex.add_argument("--state", choices=["pending", "trained", "all"], default="all", help="which corrections (default all)")
    ex.set_defaults(func=lambda a: run_client_command(_export, a))

    for parser in (add, ls, show, rm, train, ex):
        add_url_argument(parser)



def _add(client: ServerClient, args) -> int:
    body: dict[str, Any] = {"corrected": {"role": "assistant", "content": args.corrected}}
    given = [x for x in (args.request_id, args.prompt, args.messages) if x]
    if len(given) != 1:
        raise ServerError(0, "give exactly one of REQUEST_ID, --prompt or --messages")
    if args.request_id:
        body["request_id"] = args.request_id
    elif args.prompt:
        body["messages"] = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
    else:
        try:
            with open(args.messages, encoding="utf-8") as f:
                body["messages"] = json.load(f)
        except (OSError, ValueError) as e:
            raise ServerError(0, f"cannot read {args.messages}: {e}") from None
    if args.prompt_index is not None:
        body["prompt_index"] = args.prompt_index
    if args.note:
        body["note"] = args.note
    c = client.post("/v1/corrections", json=body)
    print(f"{c['id']}: pending" + (f" (corrects {c['request_id']})" if c.get("request_id") else ""))
    return 0


def _text(msg: dict[str, Any] | None, limit: int = 60) -> str:
    if not msg:
        return ""
    content = msg.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    return text if len(text) <= limit else text[:limit] + "…"


def _list(client: ServerClient, args) -> int:
    body = client.get("/v1/corrections", params={"state": args.state})
    if args.json:
        print(json.dumps(body, indent=2, ensure_ascii=False))
        return 0
    table = Table()
    table.add_column("id", no_wrap=True)
    for name in ("state", "prompt", "original", "corrected", "trained into", "created"):
        table.add_column(name)
    for c in body["data"]:
        user = next((m for m in reversed(c["messages"]) if m.get("role") == "user"), c["messages"][-1])
        table.add_row(c["id"], c["state"], _text(user, 40), _text(c.get("original"), 30), _text(c["corrected"], 30),
                      c.get("trained_into") or "", c["created_at"])
    table_console().print(table)
    counts = body["counts"]
    print(f"{counts['pending']} pending, {counts['trained']} trained")
    return 0


def _show(client: ServerClient, args) -> int:
    print(json.dumps(client.get(f"/v1/corrections/{path_segment(args.correction_id)}"), indent=2, ensure_ascii=False))
    return 0


def _delete(client: ServerClient, args) -> int:
    body = client.delete(f"/v1/corrections/{path_segment(args.correction_id)}")
    print(f"deleted {body['id']}")
    return 0


def _train(client: ServerClient, args) -> int:
    config: dict[str, Any] = {}
    if args.config:
        try:
            config = json.loads(args.config)
        except ValueError as e:
            raise ServerError(0, f"--config is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ServerError(0, "--config must be a JSON object")
    if args.output_name:
        config["output_name"] = args.output_name
    if args.from_base:
        config["base_adapter"] = None
    if args.no_auto_load:
        config["auto_load"] = False
    receipt = client.post("/v1/corrections/train", json={"config": config})
    print(receipt["message"], file=sys.stderr)
    if args.no_follow:
        print(receipt["job_id"])
        return 0
    return report(follow(client, receipt["job_id"]), as_json=args.json, client=client)


def _export(client: ServerClient, args) -> int:
    state = None if args.state == "all" else args.state
    if (args.output is None) == (args.dataset is None):
        raise ServerError(0, "give exactly one of -o FILE and --dataset NAME")
    if args.dataset:
        body: dict[str, Any] = {"dataset": args.dataset}
        if state:
            body["state"] = state
        manifest = client.post("/v1/corrections/export", json=body)
        print(f"created dataset {manifest['name']}: {manifest['num_rows']} rows")
        return 0
    text = client.request("GET", "/v1/corrections/export", params={"state": args.state}).text
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {text.count(chr(10))} rows to {args.output}", file=sys.stderr)
    return 0
