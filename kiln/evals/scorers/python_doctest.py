"""python_doctest: run the answer's code against the prompt's `>>>` examples (semantics.md §8.3).

The code runs in a child `python -I -S -` (isolated mode, no site) fed on stdin and killed with its
whole process group at the wall-clock timeout. That is isolation from Kiln's environment, NOT a
sandbox: run untrusted suites only where model-written code may do anything the user can.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from kiln.core.messages import message_text
from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScoreResult,
    SpecModel,
    errored,
    failed,
    invalid,
    passed,
    preview,
)

_HARNESS = r'''
import json, os, sys
_payload = json.loads(PAYLOAD)
_real_out = sys.stdout
_sink = open(os.devnull, "w")
sys.stdout = sys.stderr = _sink
_ns = {"__name__": "solution", "__builtins__": __builtins__}
_results = []
try:
    exec(compile(_payload["code"], "<solution>", "exec"), _ns)
    _import_error = None
except BaseException as e:
    _import_error = "%s: %s" % (type(e).__name__, e)
for _t in _payload["tests"]:
    if _import_error is not None:
        _results.append({"ok": False, "got": _import_error})
        continue
    try:
        try:
            _code = compile(_t["call"], "<doctest>", "eval")
        except SyntaxError:
            exec(compile(_t["call"], "<doctest>", "exec"), _ns)
            _value = None
        else:
            _value = eval(_code, _ns)
        _got = repr(_value).strip()
        _results.append({"ok": _got == _t["expected"].strip(), "got": _got})
    except BaseException as e:
        _results.append({"ok": False, "got": "%s: %s" % (type(e).__name__, e)})
_real_out.write("\n" + MARKER + json.dumps(_results) + "\n")
_real_out.flush()
'''


class PythonDoctestSpec(SpecModel):
    kind: Literal["python_doctest"] = "python_doctest"
    timeout_seconds: float = Field(default=5.0, ge=0.1)
    python_bin: str | None = None


@dataclass(frozen=True)
class Doctest:
    call: str
    expected: str


def parse_doctests(text: str) -> list[Doctest]:
    lines = text.splitlines()
    tests: list[Doctest] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line.startswith(">>> "):
            i += 1
            continue
        call = line[4:]
        i += 1
        while i < len(lines) and lines[i].strip().startswith("..."):
            call += "\n" + lines[i].strip()[3:].removeprefix(" ")
            i += 1
        expected = "None"
        j = i
        while j < len(lines):
            nxt = lines[j].strip()
            if nxt.startswith(">>>"):
                break
            if nxt and not nxt.startswith("```"):
                expected = nxt
                i = j + 1
                break
            j += 1
        tests.append(Doctest(call, expected))
    return tests


def extract_code(completion: str) -> str:
    pieces = completion.split("```")
    if len(pieces) < 2:
        return completion.strip()
    block = pieces[1]
    # The text up to the first newline is the fence's language tag.
    _, _, body = block.partition("\n")
    return body.strip()


def _last_user_text(example: Example) -> str:
    for msg in reversed(example.messages):
        if msg.get("role") == "user":
            return message_text(msg.get("content"))
    return ""


def python_binary(spec: PythonDoctestSpec) -> str:
    return spec.python_bin or os.environ.get("KILN_DOCTEST_PYTHON") or "python3"


def run_doctests(python: str, code: str, tests: list[Doctest], timeout: float) -> list[dict] | ScoreResult:
    marker = "KILN-DOCTEST-" + secrets.token_hex(16) + ":"
    payload = json.dumps({"code": code, "tests": [{"call": t.call, "expected": t.expected} for t in tests]})
    # Marker first: the payload is model text and may itself contain the word MARKER.
    script = _HARNESS.replace("MARKER", repr(marker)).replace("PAYLOAD", repr(payload))
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a timeout kills what it spawned too
        )
    except OSError as e:
        return errored(f"could not start {python!r}: {e}")
    try:
        out, err = proc.communicate(script.encode("utf-8"), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return errored(f"timeout after {timeout:.1f}s")
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    return errored(f"doctest harness gave no result (exit {proc.returncode}): {preview(err.decode('utf-8', 'replace'), 200)}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.communicate()


def score(spec: PythonDoctestSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    tests = parse_doctests(_last_user_text(example))
    if not tests:
        return invalid("no doctests (>>> lines) in the last user message")
    code = extract_code(completion_text)
    if not code:
        return invalid("no code in completion")
    results = run_doctests(python_binary(spec), code, tests, spec.timeout_seconds)
    if isinstance(results, ScoreResult):
        return results
    ok = sum(1 for r in results if r.get("ok"))
    detail = f"{ok}/{len(tests)} doctests passed"
    first_bad = next((i for i, r in enumerate(results) if not r.get("ok")), None)
    if first_bad is not None:
        t = tests[first_bad]
        detail += f"; {preview(t.call, 60)} -> {preview(str(results[first_bad].get('got')), 60)}, expected {preview(t.expected, 60)}"
    fraction = ok / len(tests)
    return passed(fraction, detail) if ok == len(tests) else failed(fraction, detail)
