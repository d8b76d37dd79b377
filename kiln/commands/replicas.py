"""`kiln replicas add|list|remove|check` against a running server (GET/POST/DELETE /v1/replicas)."""

from __future__ import annotations

from urllib.parse import quote

from kiln.commands.client import (
    ServerClient,
    add_list_command,
    add_url_argument,
    print_json,
    printed_json,
    run_client_command,
    table_console,
)


def register(sub) -> None:
    p = sub.add_parser("replicas", help="other servers (Kiln, vLLM, OpenAI-compatible) this server drives")
    cmds = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    add_url_argument(add_list_command(cmds, _list, "list replicas with their health and what was published to them"))
    a = cmds.add_parser("add", help="add a replica")
    add_url_argument(a)
    a.add_argument("name", help="the replica's name")
    a.add_argument("replica_url", metavar="URL", help="its root URL, e.g. http://10.0.0.7:8000")
    a.add_argument("--kind", choices=["kiln", "vllm", "openai"], default="kiln", help="what it runs (default kiln)")
    a.add_argument("--api-key-env", help="environment variable (on the server) holding its API key")
    a.add_argument("--max-concurrency", type=int, help="requests kept in flight to it at once (default 8)")
    a.add_argument("--base-model", help="the name it serves our base model under (default: our served model id)")
    a.add_argument("--lora-dir", help="vLLM: a folder this server writes adapters into and the replica reads")
    a.add_argument("--lora-dir-remote", help="vLLM: the same folder as the replica sees it (default: --lora-dir)")
    a.set_defaults(func=lambda args: run_client_command(_add, args))
    for name, func, text in (("remove", _remove, "remove a replica added over the API"),
                             ("check", _check, "probe a replica now and show its status")):
        c = cmds.add_parser(name, help=text)
        add_url_argument(c)
        c.add_argument("name", help="a replica (kiln replicas list)")
        c.set_defaults(func=lambda args, f=func: run_client_command(f, args))


def _list(client: ServerClient, args) -> int:
    data = client.get("/v1/replicas")
    if printed_json(args, data):
        return 0
    from rich.table import Table

    table = Table("name", "kind", "url", "state", "base model", "serving (adapter@revision)", "failed pushes",
                  "problem")
    for r in data["data"]:
        st = r["status"]
        adapters = ", ".join(f"{a}@{rec['revision'][7:19]}" for a, rec in r["published"].items())
        failed = ", ".join(f"{a}@{rec['revision'][7:19]}: {rec['error']}"
                           for a, rec in r.get("failed_pushes", {}).items())
        table.add_row(r["name"], r["kind"], r["url"], st["state"], ", ".join(st["base_models"]) or "-",
                      adapters or "-", failed or "-", st.get("compatibility_problem") or st.get("error") or "")
    table_console().print(table)
    return 0


def _add(client: ServerClient, args) -> int:
    body = {"name": args.name, "url": args.replica_url, "kind": args.kind}
    for key in ("api_key_env", "max_concurrency", "base_model", "lora_dir", "lora_dir_remote"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    print_json(client.post("/v1/replicas", json=body))
    return 0


def _remove(client: ServerClient, args) -> int:
    print_json(client.delete(f"/v1/replicas/{quote(args.name, safe='')}"))
    return 0


def _check(client: ServerClient, args) -> int:
    print_json(client.post(f"/v1/replicas/{quote(args.name, safe='')}/check"))
    return 0
