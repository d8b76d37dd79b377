"""`kiln chat`: talk to a running server from the terminal (streams tokens as they arrive)."""

from __future__ import annotations

import json
import sys

import httpx

from kiln.commands.client import ServerError, add_url_argument


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a running Kiln server",
                       description="Interactive chat against a running server; -m sends one message and exits.")
    add_url_argument(p)
    p.add_argument("-m", "--message", help="send one message, print the reply and exit")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--adapter", help="adapter to use ('' for the base model; default: the server's active one)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the model's)")
    p.add_argument("--seed", type=int, help="sampling seed, for replies that repeat (default: random)")
    p.add_argument("--show-reasoning", action="store_true", help="print reasoning_content too")
    p.set_defaults(func=_run)


def _stream_reply(client: httpx.Client, body: dict, show_reasoning: bool) -> str:
    content = ""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code >= 400:
            r.read()
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            raise ServerError(r.status_code, err.get("message") or r.text, err.get("hint"), err.get("code"))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ServerError(500, chunk["error"].get("message", "stream failed"), chunk["error"].get("hint"))
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if show_reasoning and delta.get("reasoning_content"):
                    sys.stdout.write(f"\x1b[2m{delta['reasoning_content']}\x1b[0m")
                if delta.get("content"):
                    content += delta["content"]
                    sys.stdout.write(delta["content"])
                sys.stdout.flush()
    sys.stdout.write("\n")
    return content


def _run(args) -> int:
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    client = httpx.Client(base_url=args.url.rstrip("/"), timeout=600)

    def ask(text: str) -> None:
        messages.append({"role": "user", "content": text})
        body: dict = {"messages": messages, "stream": True, "max_tokens": args.max_tokens}
        for key in ("temperature", "seed"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        if args.adapter is not None:
            body["adapter"] = args.adapter
        try:
            reply = _stream_reply(client, body, args.show_reasoning)
        except BaseException:
            messages.pop()   # a turn that got no answer is not part of the conversation
            raise
        messages.append({"role": "assistant", "content": reply})

    try:
        if args.message is not None:
            ask(args.message)
            return 0
        print(f"Chatting with {args.url} — empty line or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                return 0
            try:
                ask(line)
            except ServerError as e:   # one failed turn does not end the session: say why, keep going
                e.print()
            except httpx.ConnectError:
                ServerError(0, f"cannot reach a Kiln server at {args.url}",
                            "Start one with `kiln serve`, or pass --url / set KILN_SERVER_URL.").print()
    except httpx.ConnectError:
        ServerError(0, f"cannot reach a Kiln server at {args.url}",
                    "Start one with `kiln serve`, or pass --url / set KILN_SERVER_URL.").print()
        return 1
    except ServerError as e:
        e.print()
        return 1
