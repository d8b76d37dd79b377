"""`kiln distill self`: self-distillation on the server (POST /v1/distill/self), followed like a training job.

The teacher is the student's starting point (the base, or --base-adapter) with privileged context in its
system message: `--mode conciseness` an instruction to be brief, `--mode ground_truth_conditioning` each
row's reference answer (`reference`, or the trailing assistant turn of `messages`). The student learns to
answer the same way without it. Prompt rows and every training flag are as for `kiln train opd`.
"""

from __future__ import annotations

from kiln.commands.client import ServerClient, run_client_command
from kiln.commands.train import _common_args, _distill_args, _source_args, _submit, build_body
from kiln.commands.train_follow import EXIT_HELP


def register(sub) -> None:
    p = sub.add_parser("distill", help="self-distillation: learn to answer without privileged context")
    cmds = p.add_subparsers(dest="distill_command", metavar="ACTION", required=True)
    self_ = cmds.add_parser("self", help="distill the model with privileged context into the model without it",
                            epilog=EXIT_HELP)
    _source_args(self_, "JSONL of prompts: strings, {\"messages\": [...]} or {\"prompt\": ...}, with `reference`")
    self_.add_argument("--mode", required=True, choices=("conciseness", "ground_truth_conditioning"),
                       help="the privileged context: a brevity instruction, or each row's reference answer")
    self_.add_argument("--instruction", help="the teacher's system instruction instead of the mode's own "
                                             "({reference} is replaced by the row's reference answer)")
    _distill_args(self_)
    _common_args(self_)
    self_.set_defaults(func=lambda a: run_client_command(_submit_self, a))


def _submit_self(client: ServerClient, args) -> int:
    body = {**build_body(args, "prompts"), "mode": args.mode}
    if args.instruction:
        body["instruction"] = args.instruction
    return _submit(client, args, "/v1/distill/self", body)
