"""`kiln requests export`: turn the durable request log into an `sft_chat` dataset file.

Reads the log directory directly (the server may be running: a row being written is skipped, never an
error), so it needs the same settings as `kiln serve` to find it: `--dir`, or `--config` /
`--data-dir` / `KILN_REQUEST_LOG_DIR`, default <data_dir>/requests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kiln.config import ConfigError, load_settings
from kiln.traffic.export import DEFAULT_FINISH_REASONS, ExportFilter, ExportStats, parse_when, sft_rows
from kiln.traffic.request_log import log_files, read_rows


def register(sub) -> None:
    p = sub.add_parser("requests", help="export served requests from the request log")
    cmds = p.add_subparsers(dest="requests_command", metavar="ACTION", required=True)
    ex = cmds.add_parser(
        "export", help="write logged requests as an sft_chat dataset file (one row per served choice)",
        description="Write the conversations the server answered, each with the answer it gave, as sft_chat "
        "JSONL. By default only successful requests whose answer ended naturally (finish_reason stop or "
        "tool_calls) are written. Upload the file with `kiln datasets upload NAME FILE`.")
    ex.add_argument("-o", "--output", required=True, help="output JSONL file ('-' for stdout)")
    ex.add_argument("--since", help="only requests created at or after this: 2026-12-01, 2026-12-01T14:30 (UTC), "
                    "or a relative 30m / 2h / 7d")
    ex.add_argument("--until", help="only requests created before this (same forms as --since)")
    ex.add_argument("--adapter", help="only requests served by this adapter ('base' for the base model)")
    ex.add_argument("--kind", choices=["chat", "batch", "all"], default="all", help="which endpoint (default all)")
    ex.add_argument("--finish-reason", action="append", dest="finish_reasons", metavar="REASON",
                    help=f"keep choices with this finish reason (repeatable; default {', '.join(DEFAULT_FINISH_REASONS)}; "
                    "'any' keeps all)")
    ex.add_argument("--include-failed", action="store_true", help="also requests that failed or were cancelled")
    ex.add_argument("--dir", help="the request-log directory (default: [request_log] dir from the settings)")
    ex.add_argument("--config", help="TOML config file, as for `kiln serve`")
    ex.add_argument("--data-dir", help="data directory, as for `kiln serve` (the log is <data_dir>/requests)")
    ex.set_defaults(func=_export)


def _log_dir(args) -> Path:
    if args.dir:
        return Path(args.dir)
    overrides = {"data": {"data_dir": args.data_dir}} if args.data_dir else None
    return load_settings(args.config, overrides).request_log_dir


def _export(args) -> int:
    try:
        root = _log_dir(args)
        flt = ExportFilter(
            since=parse_when(args.since) if args.since else None,
            until=parse_when(args.until) if args.until else None,
            adapter=args.adapter,
            statuses=("ok", "error", "rejected", "timeout", "cancelled") if args.include_failed else ("ok",),
            finish_reasons=None if args.finish_reasons and "any" in args.finish_reasons
            else tuple(args.finish_reasons or DEFAULT_FINISH_REASONS),
            kinds=("chat", "batch") if args.kind == "all" else (args.kind,),
        )
    except (ConfigError, ValueError) as e:
        print(f"kiln requests export: {e}", file=sys.stderr)
        return 2
    if not log_files(root):
        print(f"kiln requests export: no request log in {root} (is [request_log] enabled?)", file=sys.stderr)
        return 1
    stats = ExportStats()
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for row in sft_rows(read_rows(root), flt, stats):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(stats.skipped.items()))
    print(f"wrote {stats.exported} rows from {stats.requests} matching requests"
          + (f" (skipped: {skipped})" if skipped else "") + f" to {args.output}", file=sys.stderr)
    return 0
