"""A small HTTP client for the CLI sub-commands that talk to a running server."""

from __future__ import annotations

import json
import os
import sys
from typing import Any
from urllib.parse import quote

import httpx

DEFAULT_URL = "http://127.0.0.1:8420"


def path_segment(value: str) -> str:
    """`value` quoted as one URL path segment: a name holding '/' or '?' still names one resource."""
    return quote(value, safe="")


def add_url_argument(parser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("KILN_SERVER_URL", DEFAULT_URL),
        help="Kiln server base URL (default: $KILN_SERVER_URL or %(default)s)",
    )


class ServerError(Exception):
    def __init__(self, status: int, message: str, hint: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.hint, self.code = status, message, hint, code

    def print(self) -> None:
        code = f" [{self.code}]" if self.code else ""
        print(f"error {self.status}{code}: {self.message}", file=sys.stderr)
        if self.hint:
            print(f"hint: {self.hint}", file=sys.stderr)


class ServerClient:
    def __init__(self, url: str, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ServerError(0, f"cannot reach a Kiln server at {self.url}",
                              hint="Start one with `kiln serve`, or pass --url / set KILN_SERVER_URL.") from None
        if resp.status_code >= 400:
            try:
                err = resp.json().get("error", {})
            except ValueError:
                err = {}
            raise ServerError(resp.status_code, err.get("message") or resp.text, err.get("hint"), err.get("code"))
        return resp

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw).json()

    def post(self, path: str, **kw: Any) -> Any:
        return self.request("POST", path, **kw).json()

    def put(self, path: str, **kw: Any) -> Any:
        return self.request("PUT", path, **kw).json()

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw).json()


# rich squeezes a table into 80 columns when stdout is a pipe or a file (no terminal to measure), which
# cuts ids, states and numbers to "compl…"; a table printed there gets this width instead.
PIPED_TABLE_WIDTH = 200


def table_console():
    """The console tables print to: the terminal's width, or PIPED_TABLE_WIDTH when stdout is not one."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPED_TABLE_WIDTH)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def printed_json(args, value: Any) -> bool:
    """With --json, print `value` as JSON and say so (the caller returns); otherwise print nothing."""
    if getattr(args, "json", False):
        print_json(value)
        return True
    return False


def add_list_command(cmds, func, help_text: str):
    """A `list` sub-command with --json, run against the server."""
    ls = cmds.add_parser("list", help=help_text)
    ls.add_argument("--json", action="store_true", help="print the raw JSON response")
    ls.set_defaults(func=lambda a: run_client_command(func, a))
    return ls


def run_client_command(func, args) -> int:
    """Run `func(client, args)`, printing server errors with message and hint; exit 1 on error."""
    client = ServerClient(args.url)
    try:
        return int(func(client, args) or 0)
    except ServerError as e:
        e.print()
        return 1
