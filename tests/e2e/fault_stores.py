"""What the server-level fault test writes to each store over HTTP, and how it checks the writes afterwards.

One `StoreDriver` per store. `write` makes one change and returns its key once the server answered
2xx (acknowledged), None when the server refused it (a 4xx/503 is not a lost write); a connection
error mid-write propagates (the kill). `check` gets every key acknowledged so far and returns the
problems: an acknowledged write that is not readable, or anything listed that is half-written.
To cover a new store (the request log, corrections), add a driver to `DRIVERS`.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from kiln.adapters.active import STATE_FILE

OK = (200, 201)
QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]


def _ok(r: httpx.Response) -> bool:
    return r.status_code in OK


@dataclass
class StoreDriver:
    name: str = "store"
    acked: list[str] = field(default_factory=list)

    def setup(self, c: httpx.Client) -> None:
        """Once after every start (idempotent)."""

    def write(self, c: httpx.Client, tag: str) -> str | None:
        raise NotImplementedError

    def check(self, c: httpx.Client) -> list[str]:
        raise NotImplementedError


class Datasets(StoreDriver):
    def __init__(self) -> None:
        super().__init__("datasets")
        self.sizes: dict[str, int] = {}

    def write(self, c: httpx.Client, tag: str) -> str | None:
        n = 3 + len(tag) % 5
        rows = [{"messages": [{"role": "user", "content": f"q{i} {tag}"},
                              {"role": "assistant", "content": "a" * (50 + 30 * i)}]} for i in range(n)]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        name = f"ds-{tag}"
        r = c.post("/v1/eval/datasets/upload", data={"name": name, "format": "sft_chat"},
                   files={"file": ("d.jsonl", data, "application/jsonl")})
        if not _ok(r):
            return None
        self.sizes[name] = n
        return name

    def check(self, c: httpx.Client) -> list[str]:
        problems = []
        listed = {m["name"] for m in c.get("/v1/eval/datasets").json()["datasets"]}
        for name in self.acked:
            if name not in listed:
                problems.append(f"dataset {name} acknowledged but not listed")
        for name in listed:
            r = c.get(f"/v1/eval/datasets/{name}")
            if r.status_code != 200:
                problems.append(f"dataset {name} listed but unreadable: {r.status_code}")
                continue
            want = self.sizes.get(name)
            if want is not None and r.json()["num_rows"] != want:
                problems.append(f"dataset {name} has {r.json()['num_rows']} rows, not {want}")
        return problems


class Suites(StoreDriver):
    def __init__(self) -> None:
        super().__init__("suites")
        self.sizes: dict[str, int] = {}

    def write(self, c: httpx.Client, tag: str) -> str | None:
        name = f"suite-{tag}"
        self.sizes[name] = 2 + len(tag) % 3
        r = c.post("/v1/eval/suites", json=suite_body(name, n=self.sizes[name]))
        return name if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        problems = []
        r = c.get("/v1/eval/suites")
        if r.status_code != 200:
            return [f"suite list unreadable: {r.status_code} {r.text[:200]}"]
        listed = {s["name"] for s in r.json()["suites"]}
        problems += [f"suite {name} acknowledged but not listed" for name in self.acked if name not in listed]
        for name in listed | set(self.acked):
            r = c.get(f"/v1/eval/suites/{name}")
            if r.status_code != 200:
                problems.append(f"suite {name} acknowledged or listed but unreadable: {r.status_code}")
            elif name in self.sizes and len(r.json()["examples"]) != self.sizes[name]:
                problems.append(f"suite {name} has {len(r.json()['examples'])} examples, not {self.sizes[name]}")
        return problems


def suite_body(name: str, n: int = 2) -> dict[str, Any]:
    return {"name": name, "schema_version": 2, "default_scorer": {"kind": "regex", "pattern": "."},
            "generation": {"max_tokens": 4, "temperature": 0},
            "examples": [{"id": f"e{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(n)]}


class Judgments(StoreDriver):
    SET = "fault-prefs"

    def __init__(self) -> None:
        super().__init__("judgments")

    def setup(self, c: httpx.Client) -> None:
        r = c.post("/v1/judgments", json={"name": self.SET})
        assert r.status_code in (*OK, 409), r.text

    @staticmethod
    def response_a(tag: str) -> str:
        return "a" * (1 + len(tag) * 37 % 900)

    def write(self, c: httpx.Client, tag: str) -> str | None:
        r = c.post(f"/v1/judgments/{self.SET}/rows", json={
            "id": f"j-{tag}", "prompt": QUESTION, "response_a": self.response_a(tag), "response_b": "b", "winner": "a"})
        return f"j-{tag}" if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        r = c.get(f"/v1/judgments/{self.SET}/rows")
        if r.status_code != 200:
            return [f"judgment rows unreadable: {r.status_code}"]
        body = r.json()
        rows = body["rows"] if isinstance(body, dict) else body
        have = {row["id"] for row in rows}
        problems = [f"judgment {j} acknowledged but missing" for j in self.acked if j not in have]
        for row in rows:  # every visible row is whole: its long field as written
            if row["id"].startswith("j-") and row.get("response_a") != self.response_a(row["id"][2:]):
                problems.append(f"judgment {row['id']} is not whole")
        return problems


class Adapters(StoreDriver):
    def __init__(self, model_dir: Path) -> None:
        super().__init__("adapters")
        self.archive = _adapter_archive(model_dir)

    def write(self, c: httpx.Client, tag: str) -> str | None:
        name = f"ad-{tag}"
        r = c.post("/v1/adapters/upload", data={"name": name},
                   files={"archive": (f"{name}.tar.gz", self.archive, "application/gzip")})
        return name if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        problems = []
        names = {a["name"] for a in c.get("/v1/adapters").json()["available"]}
        for name in self.acked:
            if name not in names:
                problems.append(f"adapter {name} acknowledged but not listed")
        for name in names:
            r = c.get(f"/v1/adapters/{name}/detail")
            if r.status_code != 200 or not r.json().get("content_sha256"):
                problems.append(f"adapter {name} listed but incomplete: {r.status_code} {r.text[:200]}")
        return problems


def _adapter_archive(model_dir: Path) -> bytes:
    from kiln.adapters.peft_format import config_dict
    from kiln.adapters.store import AdapterStore
    from kiln.model.config import ModelConfig
    from kiln.model.lora import module_shapes

    cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    factors = {(layer, m): (torch.randn(2, shapes[m][0], generator=gen), torch.randn(shapes[m][1], 2, generator=gen))
               for layer in range(cfg.num_hidden_layers) for m in ("q_proj", "v_proj")}
    with tempfile.TemporaryDirectory() as tmp:
        store = AdapterStore(Path(tmp))
        store.save_adapter("x", factors, config_dict(2, 4.0, ["q_proj", "v_proj"]))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for f in sorted((Path(tmp) / "x").iterdir()):
                tar.add(f, arcname=f.name)
    return buf.getvalue()


class EvalJobs(StoreDriver):
    SUITE = "fault-eval"

    def __init__(self) -> None:
        super().__init__("eval_jobs")

    def setup(self, c: httpx.Client) -> None:
        r = c.post("/v1/eval/suites", params={"force": "true"}, json=suite_body(self.SUITE))
        assert r.status_code in OK, r.text

    def write(self, c: httpx.Client, tag: str) -> str | None:
        r = c.post("/v1/eval/run", json={"suite": self.SUITE, "seed": len(tag)})
        return r.json()["job_id"] if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        problems = []
        listed = {j["job_id"] for j in c.get("/v1/eval/jobs").json()["jobs"]}
        for job_id in set(self.acked) | listed:
            r = c.get(f"/v1/eval/jobs/{job_id}")
            if r.status_code != 200:
                problems.append(f"eval job {job_id} acknowledged or listed but unreadable: {r.status_code}")
        return problems


class TrainJobs(StoreDriver):
    def __init__(self) -> None:
        super().__init__("training_jobs")

    def write(self, c: httpx.Client, tag: str) -> str | None:
        r = c.post("/v1/train/sft", json={
            "examples": [{"messages": [*QUESTION, {"role": "assistant", "content": f"Quillton {tag}."}]}],
            "config": {"output_name": f"tr-{tag}", "epochs": 2, "lora_rank": 2, "checkpoint_interval": 1}})
        return r.json()["job_id"] if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        problems = []
        listed = {j["job_id"] for j in c.get("/v1/train/status").json()}
        for job_id in set(self.acked) | listed:
            r = c.get(f"/v1/train/jobs/{job_id}")
            if r.status_code != 200:
                problems.append(f"training job {job_id} acknowledged or listed but unreadable: {r.status_code}")
                continue
            job = r.json()
            if job["state"] == "completed" and c.get(f"/v1/adapters/{job['adapter_name']}/detail").status_code != 200:
                problems.append(f"training job {job_id} completed but adapter {job['adapter_name']} is missing")
        return problems


class Corrections(StoreDriver):
    def __init__(self) -> None:
        super().__init__("corrections")

    def write(self, c: httpx.Client, tag: str) -> str | None:
        r = c.post("/v1/corrections", json={"messages": QUESTION, "note": tag,
                                            "corrected": {"role": "assistant", "content": f"Quillton ({tag})."}})
        return r.json()["id"] if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        data = c.get("/v1/corrections").json()["data"]
        listed = {x["id"] for x in data}
        problems = [f"correction {i} acknowledged but missing" for i in self.acked if i not in listed]
        for x in data:  # every visible correction is whole: its answer names its own tag
            if x.get("note") and x["corrected"]["content"] != f"Quillton ({x['note']}).":
                problems.append(f"correction {x['id']} is not whole")
        return problems


class RequestLog(StoreDriver):
    """Served chats land in the request log from a writer thread after the answer (by design:
    the row is not part of the acknowledgement, so rows still queued at a kill may be missing). What
    must hold: every line on disk is a whole row, and every row is one this client was answered."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__("request_log")
        self.root = data_dir / "requests"
        self.found = 0

    def write(self, c: httpx.Client, tag: str) -> str | None:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"hi {tag}"}],
                                                 "max_tokens": 2, "temperature": 0})
        return r.json()["id"] if _ok(r) else None

    def check(self, c: httpx.Client) -> list[str]:
        from kiln.traffic.request_log import log_files

        problems, ids = [], set()
        for path in log_files(self.root):
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    try:
                        ids.add(json.loads(line)["id"])
                    except (ValueError, KeyError):
                        problems.append(f"request log {path.name} line {n} is not a whole row")
        self.found = len(ids & set(self.acked))
        return problems


def drivers(model_dir: Path, data_dir: Path) -> list[StoreDriver]:
    return [Datasets(), Suites(), Judgments(), Adapters(model_dir), EvalJobs(), TrainJobs(), Corrections(),
            RequestLog(data_dir)]


def scratch_left(data_dir: Path) -> list[str]:
    """Entries that only a write in progress may leave: hidden names (but the lock folders and the
    committed record of the default adapter) and *.tmp."""
    out = []
    for path in data_dir.rglob("*"):
        parts = path.relative_to(data_dir).parts
        if ".locks" in parts or parts == ("adapters", STATE_FILE):
            continue
        if path.name.startswith(".") or path.name.endswith(".tmp"):
            out.append(str(path.relative_to(data_dir)))
    return sorted(out)
