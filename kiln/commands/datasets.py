"""`kiln datasets upload|list|show|split|delete` against a running server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from kiln.commands.client import (
    ServerClient,
    add_list_command,
    add_url_argument,
    path_segment,
    print_json,
    printed_json,
    run_client_command,
    table_console,
)

# Below this size an upload finishes before a progress bar would be worth drawing.
PROGRESS_MIN_BYTES = 1 << 20


def register(sub) -> None:
    p = sub.add_parser("datasets", help="upload, inspect, re-split and delete datasets")
    cmds = p.add_subparsers(dest="datasets_command", metavar="ACTION", required=True)

    up = cmds.add_parser("upload", help="upload a JSONL (or JSON array) file as a named dataset")
    up.add_argument("name", help="dataset name (one path segment, e.g. support-v1)")
    up.add_argument("file", type=Path, help="local JSONL file (or a JSON array), one row per line")
    up.add_argument("--format", default="sft_chat", help="sft_chat|sft|grpo_groups|grpo|raw (default sft_chat)")
    up.add_argument("--description", help="free text shown by `kiln datasets list`")
    up.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    up.set_defaults(func=lambda a: run_client_command(_upload, a))

    ls = add_list_command(cmds, _list, "list datasets, newest first")

    show = cmds.add_parser("show", help="print a dataset manifest, optionally with its first rows")
    show.add_argument("name", help="dataset name")
    show.add_argument("--rows", type=int, metavar="N", help="also print the first N rows")
    show.add_argument("--split", choices=["train", "validation", "holdout"], help="rows from one partition")
    show.set_defaults(func=lambda a: run_client_command(_show, a))

    sp = cmds.add_parser("split", help="show the split, or re-split with a new seed or percentages")
    sp.add_argument("name", help="dataset name")
    sp.add_argument("--seed", help="unsigned 64-bit seed")
    sp.add_argument("--train", type=int, dest="train_percent", help="train percent (1-98)")
    sp.add_argument("--validation", type=int, dest="validation_percent", help="validation percent (0-98)")
    sp.add_argument("--json", action="store_true", help="print the whole split manifest")
    sp.set_defaults(func=lambda a: run_client_command(_split, a))

    rm = cmds.add_parser("delete", help="delete a dataset")
    rm.add_argument("name", help="dataset name")
    rm.set_defaults(func=lambda a: run_client_command(_delete, a))

    for parser in (up, ls, show, sp, rm):
        add_url_argument(parser)



class ProgressReader:
    """A file wrapper that reports how far the HTTP client has read it."""

    def __init__(self, f: BinaryIO, on_position) -> None:
        self._f, self._on_position = f, on_position

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._on_position(self._f.tell())
        return data

    def seek(self, *args: Any) -> int:
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()


def _upload(client: ServerClient, args) -> int:
    if not args.file.is_file():
        print(f"error: {args.file} is not a file")
        return 1
    size = os.path.getsize(args.file)
    data = {"name": args.name, "format": args.format}
    if args.description:
        data["description"] = args.description
    console = Console(stderr=True)
    show_bar = size >= PROGRESS_MIN_BYTES and not args.no_progress
    with open(args.file, "rb") as f, Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=console, disable=not show_bar, transient=False,
    ) as progress:
        task = progress.add_task(f"uploading {args.file.name}", total=size)
        reader = ProgressReader(f, lambda pos: progress.update(task, completed=pos))
        files = {"file": (args.file.name, reader, "application/jsonl")}
        manifest = client.post("/v1/eval/datasets/upload", data=data, files=files)
    counts = manifest["split_counts"]
    print(f"uploaded {manifest['name']}: {manifest['num_rows']} rows ({manifest['format']}), "
          f"train {counts['train']} / validation {counts['validation']} / holdout {counts['holdout']}")
    print(f"corpus {manifest['corpus_sha256']}")
    return 0


def _list(client: ServerClient, args) -> int:
    body = client.get("/v1/eval/datasets")
    if printed_json(args, body):
        return 0
    table = Table("name", "format", "rows", "train", "val", "holdout", "updated", "description")
    for m in body["datasets"]:
        c = m["split_counts"]
        table.add_row(m["name"], m["format"], str(m["num_rows"]), str(c["train"]), str(c["validation"]),
                      str(c["holdout"]), m["updated_at"], m.get("description") or "")
    table_console().print(table)
    return 0


def _show(client: ServerClient, args) -> int:
    print_json(client.get(f"/v1/eval/datasets/{path_segment(args.name)}"))
    if args.rows:
        params: dict[str, Any] = {"limit": args.rows}
        if args.split:
            params["split"] = args.split
        body = client.get(f"/v1/eval/datasets/{path_segment(args.name)}/rows", params=params)
        for row in body["rows"]:
            print(json.dumps(row, ensure_ascii=False))
    return 0


def _split(client: ServerClient, args) -> int:
    path = f"/v1/eval/datasets/{path_segment(args.name)}/split"
    changes = {k: getattr(args, k) for k in ("seed", "train_percent", "validation_percent")}
    manifest = client.get(path)
    if any(v is not None for v in changes.values()):
        config = {**manifest["config"], **{k: v for k, v in changes.items() if v is not None}}
        manifest = client.put(path, json=config)
    if printed_json(args, manifest):
        return 0
    cfg, c = manifest["config"], manifest["counts"]
    print(f"{args.name}: seed {cfg['seed']}, {cfg['train_percent']}% train / {cfg['validation_percent']}% validation")
    print(f"rows: train {c['train']} / validation {c['validation']} / holdout {c['holdout']}")
    return 0


def _delete(client: ServerClient, args) -> int:
    body = client.delete(f"/v1/eval/datasets/{path_segment(args.name)}")
    print(f"{body['status']} {body['name']}")
    return 0
