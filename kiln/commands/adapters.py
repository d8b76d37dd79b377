"""`kiln adapters list|load|unload|upload|download|merge|delete|publish|unpublish|export` against a running
server."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path
from urllib.parse import quote

import httpx

from kiln.commands.client import ServerClient, ServerError, add_url_argument, printed_json, run_client_command
from kiln.store.folder_archive import pack_folder


def register(sub) -> None:
    p = sub.add_parser("adapters", help="manage the server's LoRA adapters")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help_text: str, func) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help_text)
        add_url_argument(a)
        a.set_defaults(func=lambda args: run_client_command(func, args))
        return a

    a = action("list", "list saved adapters and the active one", _list)
    a.add_argument("--json", action="store_true", help="print the raw JSON response")
    a = action("load", "make a saved adapter the server's default", _load)
    a.add_argument("name", help="a stored adapter (kiln adapters list)")
    action("unload", "revert the server to the base model", _unload)
    a = action("upload", "upload an adapter folder or .tar.gz", _upload)
    a.add_argument("name", help="name to store the adapter under")
    a.add_argument("path", help="PEFT adapter folder, or a .tar.gz of one")
    a = action("download", "download an adapter as .tar.gz", _download)
    a.add_argument("name", help="a stored adapter")
    a.add_argument("-o", "--output", help="output file (default: ./<name>.tar.gz; '-' for stdout)")
    a = action("merge", "merge saved adapters into a new one", _merge)
    a.add_argument("output_name", help="name of the merged adapter to create")
    a.add_argument("sources", nargs="+", metavar="NAME[:WEIGHT]", help="source adapters (weight default 1)")
    a.add_argument("--mode", choices=["weighted_average", "ties", "concat"], default=None,
                   help="weighted_average (default): the weighted sum of same-rank factors (weights not normalized); "
                   "ties: TIES merging (--density); concat: the factors stacked, any ranks, exactly the weighted "
                   "sum of the deltas")
    a.add_argument("--density", type=float, default=None, help="ties only: fraction of values kept (0, 1]")
    a = action("delete", "delete a saved adapter", _delete)
    a.add_argument("name", help="a stored adapter (not the active one: unload it first)")
    for verb, func in (("publish", _publish), ("unpublish", _unpublish)):
        a = action(verb, f"{verb} an adapter {'to' if verb == 'publish' else 'from'} replicas (kiln replicas list)",
                   func)
        a.add_argument("name", help="a stored adapter")
        a.add_argument("--replicas", default="all", help="comma-separated replica names, or all (default)")
        if verb == "publish":
            a.add_argument("--activate", action="store_true", help="Kiln replicas: also make it their default adapter")
    a = action("export", "export an adapter for vLLM / PEFT (a PEFT folder) or llama.cpp (a LoRA GGUF)", _export)
    a.add_argument("name", help="a stored adapter")
    a.add_argument("dir", help="output folder: the PEFT files go in it, the GGUF is written as DIR/NAME.gguf")
    a.add_argument("--format", choices=["peft", "vllm", "gguf"], default="peft",
                   help="peft (default): adapter_config.json naming the real base model + safetensors; "
                   "vllm: the same PEFT folder and only the `vllm serve --enable-lora --lora-modules` line; "
                   "gguf: a llama.cpp LoRA adapter (llama-server --lora)")


def _list(client: ServerClient, args) -> int:
    data = client.get("/v1/adapters")
    if printed_json(args, data):
        return 0
    active = data.get("active")
    print(f"active: {active or 'base'}")
    for a in data.get("available", []):
        mark = "*" if a["name"] == active else " "
        ok = "ok" if a.get("has_config") and a.get("has_weights") else "incomplete"
        digest = (a.get("content_sha256") or "")[:19]
        print(f"{mark} {a['name']:<32} {a['size_bytes']:>12} B  {a['modified_at']}  {ok}  {digest}")
    return 0


def _load(client: ServerClient, args) -> int:
    data = client.post("/v1/adapters/load", json={"name": args.name})
    print(f"loaded {data['name']} ({data.get('content_sha256', '')})")
    return 0


def _unload(client: ServerClient, args) -> int:
    client.post("/v1/adapters/unload")
    print("unloaded: serving the base model")
    return 0


def _upload(client: ServerClient, args) -> int:
    path = Path(args.path)
    if path.is_dir():
        payload = pack_folder(path)
    elif path.is_file():
        payload = path.read_bytes()
    else:
        raise ServerError(0, f"{path} is neither a folder nor a file", hint="Pass a PEFT adapter folder or a .tar.gz.")
    data = client.post("/v1/adapters/upload", data={"name": args.name},
                       files={"archive": (f"{args.name}.tar.gz", payload, "application/gzip")})
    print(f"uploaded {data['name']} ({data['size_bytes']} bytes, {data.get('content_sha256', '')})")
    return 0


def _download(client: ServerClient, args) -> int:
    out = args.output or f"{args.name}.tar.gz"
    # Streamed straight to disk; ServerClient.request would buffer the whole archive.
    try:
        _stream_download(client, args.name, out)
    except httpx.ConnectError:
        raise ServerError(0, f"cannot reach a Kiln server at {client.url}",
                          hint="Start one with `kiln serve`, or pass --url / set KILN_SERVER_URL.") from None
    if out != "-":
        print(f"wrote {out}")
    return 0


def _stream_download(client: ServerClient, name: str, out: str) -> None:
    with client.http.stream("GET", f"/v1/adapters/{quote(name, safe='')}/download") as resp:
        if resp.status_code >= 400:
            resp.read()
            _raise(resp)
        if out == "-":
            for chunk in resp.iter_bytes():
                sys.stdout.buffer.write(chunk)
            return
        tmp = Path(f"{out}.part")
        with open(tmp, "wb") as f:
            for chunk in resp.iter_bytes():
                f.write(chunk)
        tmp.replace(out)


def _raise(resp) -> None:
    try:
        err = resp.json().get("error", {})
    except ValueError:
        err = {}
    raise ServerError(resp.status_code, err.get("message") or resp.text, err.get("hint"), err.get("code"))


def parse_source(text: str) -> dict:
    name, sep, weight = text.rpartition(":")
    if not sep:
        return {"name": text, "weight": 1.0}
    try:
        return {"name": name, "weight": float(weight)}
    except ValueError:
        return {"name": text, "weight": 1.0}


def _merge(client: ServerClient, args) -> int:
    body: dict = {"sources": [parse_source(s) for s in args.sources], "output_name": args.output_name}
    if args.mode:
        body["mode"] = args.mode
    if args.density is not None:
        body["density"] = args.density
    data = client.post("/v1/adapters/merge", json=body)
    print(f"merged {len(data['sources'])} adapter(s) into {data['output_name']} "
          f"(mode {data['mode']}, {data['num_tensors']} tensors)")
    return 0


def _delete(client: ServerClient, args) -> int:
    client.delete(f"/v1/adapters/{quote(args.name, safe='')}")
    print(f"deleted {args.name}")
    return 0


def _replicas(text: str):
    return "all" if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]


def _publish_result(resp: httpx.Response) -> int:
    body = resp.json()
    if "replicas" not in body:  # an error envelope
        _raise(resp)
    for name, entry in body["replicas"].items():
        what = entry.get("action") or entry["status"]
        tail = f" after {entry['attempts']} attempt(s): {entry['error']}" if entry["status"] == "failed" else ""
        print(f"{name}: {what}{tail}")
    return 1 if body["failed"] else 0


def _post_publication(client: ServerClient, path: str, body: dict) -> int:
    # not client.request: a 502 still carries each replica's outcome, which is what to print
    try:
        resp = client.http.post(path, timeout=600, json=body)
    except httpx.ConnectError:
        raise ServerError(0, f"cannot reach a Kiln server at {client.url}",
                          hint="Start one with `kiln serve`, or pass --url / set KILN_SERVER_URL.") from None
    return _publish_result(resp)


def _publish(client: ServerClient, args) -> int:
    return _post_publication(client, f"/v1/adapters/{quote(args.name, safe='')}/publish",
                             {"replicas": _replicas(args.replicas), "activate": args.activate})


def _unpublish(client: ServerClient, args) -> int:
    return _post_publication(client, f"/v1/adapters/{quote(args.name, safe='')}/unpublish",
                             {"replicas": _replicas(args.replicas)})


def _export(client: ServerClient, args) -> int:
    out = Path(args.dir)
    wire_format = "gguf" if args.format == "gguf" else "peft"  # a vLLM folder is a PEFT folder
    resp = client.request("GET", f"/v1/adapters/{quote(args.name, safe='')}/export", params={"format": wire_format})
    base = resp.headers.get("x-kiln-base-model")
    base_gguf = resp.headers.get("x-kiln-base-model-gguf")
    rank = int(resp.headers.get("x-kiln-max-lora-rank", "0") or 0)
    from kiln.adapters.export import BaseModelRef, serve_commands

    ref = BaseModelRef(base, base_gguf)
    out.mkdir(parents=True, exist_ok=True)
    if wire_format == "peft":
        with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
            tar.extractall(out, filter="data")
        print(f"wrote the PEFT adapter {args.name} to {out} (base_model_name_or_path: {base or 'unknown'})")
        lines = serve_commands(args.name, ref, peft_dir=out.resolve(), gguf_file=None, max_rank=rank)
    else:
        path = out / f"{args.name}.gguf"
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(resp.content)
        tmp.replace(path)
        print(f"wrote the llama.cpp LoRA adapter {path} ({len(resp.content)} bytes)")
        lines = serve_commands(args.name, ref, peft_dir=None, gguf_file=path.resolve(), max_rank=rank)
    print("serve it with:")
    for line in lines:
        print(f"  {line}")
    if args.format == "vllm":
        body = json.dumps({"lora_name": args.name, "lora_path": str(out.resolve())})
        print("or load it into a running vLLM (started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True):")
        print(f"  curl -X POST http://VLLM_HOST:8000/v1/load_lora_adapter -H 'Content-Type: application/json' "
              f"-d '{body}'")
    return 0
