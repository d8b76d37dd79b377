"""HTTP servers on loopback for replica tests: a stand-in that speaks vLLM's LoRA protocol and can be told
to refuse loads, and a fault-injecting proxy in front of a real server.

FakeVllm keeps what vLLM keeps (LoRA name -> path; a name loads once; /v1/models lists each module with
its `parent`) and answers a chat with the folder the requested model was loaded from, so a test can see
which revision answers. It is no model server: the vLLM engine itself is checked on a GPU only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx


class _Server:
    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {"Content-Type": "application/json"}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


class FakeVllm(_Server):
    """`refuse(name, path) -> HTTP status or None` decides whether a load fails (None: it loads)."""

    def __init__(self, base: str = "tiny") -> None:
        self.base = base
        self.loras: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []
        self.refuse: Callable[[str, str], int | None] = lambda name, path: None
        super().__init__(_VllmHandler)


class _VllmHandler(_Handler):
    def do_GET(self) -> None:
        fake: FakeVllm = self.server.owner  # type: ignore[attr-defined]
        if self.path == "/health":
            self._send(200, b"", {})
        elif self.path == "/v1/models":
            data = [{"id": fake.base, "object": "model"}]
            data += [{"id": n, "object": "model", "parent": fake.base, "root": p} for n, p in fake.loras.items()]
            self._send(200, {"object": "list", "data": data})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        fake: FakeVllm = self.server.owner  # type: ignore[attr-defined]
        body = json.loads(self._body() or b"{}")
        fake.calls.append((self.path, body))
        name = body.get("lora_name")
        if self.path == "/v1/load_lora_adapter":
            path = body.get("lora_path", "")
            if name in fake.loras:  # vLLM's own rule
                return self._send(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}})
            status = fake.refuse(name, path)
            if status is None and not (Path(path) / "adapter_config.json").is_file():
                status = 400
            if status is not None:
                return self._send(status, {"error": {"message": f"cannot load {name} from {path}"}})
            fake.loras[name] = path
            return self._send(200, b"Success", {"Content-Type": "text/plain"})
        if self.path == "/v1/unload_lora_adapter":
            if fake.loras.pop(name, None) is None:
                return self._send(404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}})
            return self._send(200, b"Success", {"Content-Type": "text/plain"})
        if self.path == "/v1/chat/completions":
            path = fake.loras.get(body.get("model"))
            if path is None:
                return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            return self._send(200, {"choices": [{"message": {"role": "assistant", "content": Path(path).name}}]})
        self._send(404, {"error": {"message": "not found"}})


class FaultProxy(_Server):
    """Forwards every request to `target`, except that `fail(method, path) -> status or None` answers
    a request itself with that status (counted in `refused`)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.fail: Callable[[str, str], int | None] = lambda method, path: None
        self.refused: list[str] = []
        super().__init__(_ProxyHandler)


class _ProxyHandler(_Handler):
    def _forward(self) -> None:
        proxy: FaultProxy = self.server.owner  # type: ignore[attr-defined]
        body = self._body()
        status = proxy.fail(self.command, self.path)
        if status is not None:
            proxy.refused.append(f"{self.command} {self.path}")
            return self._send(status, {"error": {"message": "injected fault", "type": "server_error"}})
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        resp = httpx.request(self.command, proxy.target + self.path, content=body, headers=headers, timeout=120)
        self._send(resp.status_code, resp.content, {"Content-Type": resp.headers.get("content-type", "")})

    do_GET = do_POST = do_DELETE = _forward
