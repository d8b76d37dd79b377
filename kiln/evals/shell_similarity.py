"""How close two shell commands are, for tool arguments like `command` (semantics.md §8.4).

Identical commands score 1; the same program with the same subcommand scores by argument overlap;
the same program with another subcommand 0.35; programs of one family 0.35; unrelated programs 0.1.
Wrappers (`bash -lc '...'`, `sudo`, `env X=1`, `timeout 5`) are peeled up to four levels, and inline
Python (`python -c '...'`) is compared by code tokens.
"""

from __future__ import annotations

import os
import re
import shlex

from kiln.evals.text_similarity import code_tokens, jaccard

MAX_UNWRAP_DEPTH = 4
SAME_PROGRAM_OTHER_SUBCOMMAND = 0.35
SAME_FAMILY = 0.35
OTHER_FAMILY = 0.1

_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}
_PREFIXES = {"sudo", "env", "nohup", "nice", "time", "command", "exec", "xargs"}
_SETUP = {"cd", "export", "source", ".", "set", "pushd", "popd", "true"}
_SUBCOMMAND_PROGRAMS = {
    "git", "cargo", "npm", "yarn", "pnpm", "docker", "podman", "kubectl", "helm", "pip", "uv", "poetry",
    "go", "apt", "apt-get", "brew", "systemctl", "conda", "gh", "terraform", "make", "bun", "dotnet",
}
_FAMILIES = [
    {"grep", "rg", "ag", "ack", "egrep", "fgrep"},
    {"cat", "less", "more", "head", "tail", "bat"},
    {"ls", "find", "fd", "tree", "du"},
    {"curl", "wget", "http", "httpie"},
    {"python", "pip", "uv", "poetry", "pytest", "ipython", "conda"},
    {"node", "npm", "npx", "yarn", "pnpm", "bun", "deno"},
    {"cargo", "rustc", "rustup"},
    {"sed", "awk", "perl", "tr"},
    {"cp", "mv", "rsync", "scp", "install"},
    {"rm", "rmdir", "unlink"},
    {"docker", "podman", "kubectl", "helm"},
    {"make", "cmake", "ninja"},
    {"tar", "zip", "unzip", "gzip", "gunzip"},
]
_SEGMENT_SPLIT_RE = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")
_VERSION_SUFFIX_RE = re.compile(r"[\d.]+$")


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _program(argv0: str) -> str:
    name = os.path.basename(argv0)
    stripped = _VERSION_SUFFIX_RE.sub("", name)
    return stripped or name


def _main_segment(command: str) -> str:
    segments = [s for s in _SEGMENT_SPLIT_RE.split(command.strip()) if s]
    for seg in segments:
        argv = _split(seg)
        if argv and _program(argv[0]) not in _SETUP:
            return seg
    return segments[-1] if segments else ""


def unwrap(command: str, depth: int = 0) -> list[str]:
    """The argv of the command that does the work, wrappers and setup steps removed."""
    argv = _split(_main_segment(command))
    while argv:
        prog = _program(argv[0])
        if "=" in argv[0] and not argv[0].startswith("="):  # VAR=value prefix
            argv = argv[1:]
        elif prog in _PREFIXES:
            argv = [a for a in argv[1:] if "=" not in a or a.startswith("-")] if prog == "env" else argv[1:]
            argv = _drop_flags(argv)
        elif prog == "timeout":
            argv = _drop_flags(argv[1:])[1:]
        elif prog in _SHELLS and depth < MAX_UNWRAP_DEPTH:
            script = _shell_script(argv)
            if script is None:
                return argv
            return unwrap(script, depth + 1)
        else:
            return argv
    return argv


def _drop_flags(argv: list[str]) -> list[str]:
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1
    return argv[i:]


def _shell_script(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("-") and not arg.startswith("--") and "c" in arg[1:]:
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _family(prog: str) -> int:
    for i, fam in enumerate(_FAMILIES):
        if prog in fam:
            return i
    return -1


def _inline_python(argv: list[str]) -> tuple[list[str], str] | None:
    if _program(argv[0]) != "python":
        return None
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-c" and i + 1 < len(argv):
            return argv[:i], argv[i + 1]
    return None


def _argv_similarity(t: list[str], p: list[str]) -> float:
    tp, pp = _program(t[0]), _program(p[0])
    if tp != pp:
        fam = _family(tp)
        return SAME_FAMILY if fam >= 0 and fam == _family(pp) else OTHER_FAMILY
    t_args, p_args = t[1:], p[1:]
    if tp in _SUBCOMMAND_PROGRAMS:
        t_sub = next((a for a in t_args if not a.startswith("-")), None)
        p_sub = next((a for a in p_args if not a.startswith("-")), None)
        if t_sub != p_sub:
            return SAME_PROGRAM_OTHER_SUBCOMMAND
    return 0.5 + 0.5 * jaccard(set(t_args), set(p_args))


def command_similarity(target: str, predicted: str) -> float:
    if " ".join(target.split()) == " ".join(predicted.split()):
        return 1.0
    t, p = unwrap(target), unwrap(predicted)
    if not t or not p:
        return 0.0
    if t == p:
        return 1.0
    t_py, p_py = _inline_python(t), _inline_python(p)
    if t_py and p_py:
        semantic = jaccard(code_tokens(t_py[1]), code_tokens(p_py[1]))
        return 0.75 * semantic + 0.25 * _argv_similarity(t_py[0], p_py[0])
    return _argv_similarity(t, p)
