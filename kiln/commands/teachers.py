"""`kiln teachers list|add|delete`: the server's teacher registry (models to distill from), verified when added."""

from __future__ import annotations

import json
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
    p = sub.add_parser("teachers", help="register teachers (this model with an adapter, or a remote server)")
    cmds = p.add_subparsers(dest="teachers_command", metavar="ACTION", required=True)
    ls = add_list_command(cmds, _list, "list the registered teachers")

    add = cmds.add_parser("add", help="register and verify a teacher (same tokenizer as this server's)")
    add.add_argument("alias", help="the teacher's name (immutable)")
    where = add.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="this server's base model")
    where.add_argument("--remote", metavar="URL", help="an OpenAI-compatible server (another Kiln, or vLLM)")
    add.add_argument("--adapter", help="with --local: the stored adapter the base wears")
    add.add_argument("--model-id", help="with --remote: which of its models (default: the first it lists)")
    add.add_argument("--api-key-env", help="with --remote: the server-side environment variable holding its key "
                                           "(required outside loopback)")
    add.set_defaults(func=lambda a: run_client_command(_add, a))

    rm = cmds.add_parser("delete", help="forget a teacher")
    rm.add_argument("alias", help="the teacher to forget")
    rm.set_defaults(func=lambda a: run_client_command(_delete, a))
    for parser in (ls, add, rm):
        add_url_argument(parser)


def build_body(args) -> dict[str, Any]:
    body: dict[str, Any] = {"alias": args.alias, "kind": "local" if args.local else "remote"}
    for key in ("adapter", "model_id", "api_key_env"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    if args.remote:
        body["url"] = args.remote
    return body


def _list(client: ServerClient, args) -> int:
    teachers = client.get("/v1/teachers")["teachers"]
    if printed_json(args, teachers):
        return 0
    table = Table("alias", "kind", "adapter / url", "model", "registered")
    for t in teachers:
        table.add_row(t["alias"], t["kind"], t.get("adapter") or t.get("url") or "<base>",
                      (t.get("identity") or {}).get("model_id") or "-", t["registered_at"])
    table_console().print(table)
    return 0


def _add(client: ServerClient, args) -> int:
    print(json.dumps(client.post("/v1/teachers", json=build_body(args)), indent=2))
    return 0


def _delete(client: ServerClient, args) -> int:
    print(json.dumps(client.delete(f"/v1/teachers/{path_segment(args.alias)}")))
    return 0
