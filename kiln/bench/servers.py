"""Start an HTTP server process for the benchmark (Kiln or llama.cpp) and stop it afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

from kiln.bench.client_load import BenchError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A child process serving HTTP on a loopback port; ready when `ready_path` answers 200."""

    def __init__(self, name: str, args: list[str], port: int, log_path: Path, ready_path: str,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name, self.args, self.port, self.log_path, self.ready_path = name, args, port, log_path, ready_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise BenchError(f"{self.name} server was not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
