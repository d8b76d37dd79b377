"""`kiln` command line: serve | chat | eval | bench | adapters | train | distill | datasets | judgments |
requests | corrections | replicas | teachers."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from kiln import __version__

# Each module exposes `register(subparsers)`, adding its sub-command(s) with `set_defaults(func=...)`;
# `func(args) -> int` is the exit status.
COMMAND_MODULES = [
    "kiln.commands.serve",
    "kiln.commands.chat",
    "kiln.commands.datasets",
    "kiln.commands.judgments",
    "kiln.commands.adapters",
    "kiln.commands.bench",
    "kiln.commands.eval",
    "kiln.commands.train",
    "kiln.commands.distill",
    "kiln.commands.requests",
    "kiln.commands.corrections",
    "kiln.commands.replicas",
    "kiln.commands.teachers",
]


EXAMPLES = """\
examples:
  kiln serve                                   # the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8420
  kiln serve /models/Qwen3-0.6B --port 8000    # an HF directory or a .gguf file
  kiln chat                                    # talk to the running server
  kiln train sft data.jsonl -o support-v2      # train an adapter, follow the job, hot-swap it in
  kiln eval run my-suite --adapter support-v2  # measure it

The client commands (chat, adapters, train, eval, datasets, judgments, corrections, teachers) talk to a
running server: --url (default $KILN_SERVER_URL or http://127.0.0.1:8420). `kiln COMMAND --help`
says more.
"""

# What each command group is for and how it is typically called (its `--help` epilog).
GROUPS: dict[str, tuple[str, list[str]]] = {
    "adapters": ("The server's LoRA adapter store: list, load (make the server default), unload, upload, "
                 "download, merge, delete and export stored adapters.",
                 ["kiln adapters list", "kiln adapters load support-v2", "kiln adapters upload support-v2 ./peft-folder",
                  "kiln adapters export support-v2 ./export --format gguf"]),
    "datasets": ("Named datasets on the server (sft_chat, grpo_groups, raw JSONL), each with a deterministic "
                 "train / validation / holdout split.",
                 ["kiln datasets upload support data.jsonl", "kiln datasets show support --rows 3",
                  "kiln datasets split support --seed 7 --train 80 --validation 10"]),
    "eval": ("Run eval suites against the server's model and adapters, compare adapters with paired statistics, "
             "and inspect, re-run, replay or report eval jobs.",
             ["kiln eval run my-suite --adapter support-v2", "kiln eval compare my-suite '' support-v2",
              "kiln eval jobs", "kiln eval report eval-1234 -o report.html"]),
    "train": ("Train LoRA adapters on the server with SFT, GRPO, DPO or OPD (distillation from a teacher); the new adapter is hot-swapped in when the "
              "job ends (optionally behind a post-training eval gate).",
              ["kiln train sft data.jsonl -o support-v2", "kiln train sft --dataset support -o support-v2 --epochs 5",
               "kiln train dpo --judgments prefs -o prefs-dpo", "kiln train opd prompts.jsonl --teacher tutor -o s1",
               "kiln train status",
               "kiln train status train-1234 --follow"]),
    "judgments": ("Pairwise judgment sets (which of two replies is better), compiled into training data for a "
                  "judge adapter, and that judge's held-out validation.",
                  ["kiln judgments create prefs",
                   "kiln judgments append prefs --prompt 'Say hi' --response-a hi --response-b 'Hello!' --winner b",
                   "kiln judgments compile prefs --output prefs-sft", "kiln judgments validate prefs --adapter judge-v1",
                   "kiln judgments export prefs --format openai -o prefs.jsonl"]),
    "requests": ("The server's request log (<data_dir>/requests, when [request_log] enabled = true) as training "
                 "data.",
                 ["kiln requests export --since 2h --adapter base -o rows.jsonl"]),
    "replicas": ("Other servers this one drives: Kiln replicas and vLLM or OpenAI-compatible servers, polled for "
                 "health and checked to serve the same base model before adapters are published to them.",
                 ["kiln replicas add gpu-1 http://10.0.0.7:8000 --kind vllm --lora-dir /shared/loras",
                  "kiln replicas list", "kiln replicas remove gpu-1"]),
    "corrections": ("Corrections of served answers (by completion id or conversation) and the SFT job that trains "
                    "them into an adapter.",
                    ["kiln corrections add chatcmpl-1234 -c 'The capital of Zorbania is Quillton.'",
                     "kiln corrections list", "kiln corrections train -o fixes-v1"]),
    "teachers": ("Teachers to distill from: this server's model wearing an adapter, or a remote Kiln / vLLM server "
                 "with the same tokenizer, verified when registered.",
                 ["kiln teachers add tutor --local --adapter facts-v1",
                  "kiln teachers add big --remote http://10.0.0.2:8000 --api-key-env BIG_KEY", "kiln teachers list"]),
    "distill": ("Self-distillation: the model with privileged context (a brevity instruction, or the reference "
                "answer) teaches the model without it.",
                ["kiln distill self prompts.jsonl --mode conciseness -o concise-v1",
                 "kiln distill self qa.jsonl --mode ground_truth_conditioning -o grounded-v1"]),
}


def _explain(parser: argparse.ArgumentParser, path: str = "kiln") -> None:
    """Every sub-command's `--help` opens with what it does: its one-line help where it set no description."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if path == "kiln" and name in GROUPS:
                description, examples = GROUPS[name]
                sub.description = textwrap.fill(description, 88)
                sub.epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
                sub.formatter_class = argparse.RawDescriptionHelpFormatter
            elif not sub.description and helps.get(name):
                text = helps[name]
                sub.description = text[0].upper() + text[1:] + "."
            _explain(sub, f"{path} {name}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `command` (a `COMMAND_MODULES` module's last name), that command's only:
    the others' modules (their clients: httpx, rich) are not imported, ~0.13 s of CPU off every start of
    `kiln serve`."""
    modules = [m for m in COMMAND_MODULES if command is None or m.rsplit(".", 1)[1] == command] or COMMAND_MODULES
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Serve a language model over the OpenAI API and make it better while it serves.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).register(sub)
    _explain(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `kiln COMMAND ...` parses with COMMAND's parser alone (the same arguments, the same --help); the
    # top-level help, --version and unknown commands with every command's
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
