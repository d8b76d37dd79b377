"""`kiln eval run|compare|jobs|show|report|cancel|rerun|replay`.

`run` submits a suite (a registered name, or a suite file sent inline) to the Kiln server at --url
and follows the job with a live progress bar; with --base-url it instead runs the suite right here
against any OpenAI-compatible server (vLLM, another Kiln). Both end with a summary table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln.commands.client import (
    ServerClient,
    ServerError,
    add_url_argument,
    path_segment,
    printed_json,
    run_client_command,
    table_console,
)
from kiln.errors import KilnError

POLL_SECONDS = 0.5
TERMINAL = ("completed", "failed", "cancelled")


def register(sub) -> None:
    p = sub.add_parser("eval", help="run eval suites and inspect eval jobs")
    cmds = p.add_subparsers(dest="eval_command", metavar="ACTION", required=True)

    run = cmds.add_parser("run", help="run a suite (registered name or suite file) and print a summary")
    run.add_argument("suite", metavar="SUITE_OR_FILE", help="registered suite name, or a suite JSON file/directory")
    run.add_argument("--adapter", help="adapter to evaluate (\"\" = base model; default: the server's active one)")
    run.add_argument("--seed", help="job seed (unsigned 64-bit); per-completion seeds derive from it")
    run.add_argument("--base-url", help="run here against this OpenAI-compatible base URL (e.g. http://host:8000/v1)")
    run.add_argument("--model", help="with --base-url: the model name to request (default: the server's first)")
    run.add_argument("--api-key", help="with --base-url: bearer token for the remote server")
    run.add_argument("--concurrency", type=int, default=32, help="with --base-url: requests in flight (default 32)")
    run.add_argument("--save", type=Path, metavar="PATH", help="also write the EvalResult JSON here")
    run.add_argument("--no-follow", action="store_true", help="submit and print the job id without waiting")
    run.add_argument("--json", action="store_true", help="print the EvalResult JSON instead of tables")
    run.set_defaults(func=_run_entry)

    cmp = cmds.add_parser("compare", help="run a registered suite against several adapters (\"\" = base)")
    cmp.add_argument("suite", help="a registered suite name")
    cmp.add_argument("adapters", nargs="+", metavar="ADAPTER",
                     help="targets to compare, the first is the baseline (\"\" = the base model)")
    cmp.add_argument("--seed", help="job seed (unsigned 64-bit; default: random)")
    cmp.add_argument("--no-follow", action="store_true", help="submit and print the job id without waiting")
    cmp.add_argument("--json", action="store_true", help="print the EvalResult JSON instead of tables")
    cmp.set_defaults(func=lambda a: run_client_command(_compare, a))

    jobs = cmds.add_parser("jobs", help="list eval jobs, newest first")
    jobs.add_argument("--json", action="store_true", help="print the raw JSON response")
    jobs.set_defaults(func=lambda a: run_client_command(_jobs, a))

    show = cmds.add_parser("show", help="print a job's summary (or its EvalResult JSON)")
    show.add_argument("job", help="an eval job id (eval-...)")
    show.add_argument("--json", action="store_true", help="print the EvalResult JSON instead of tables")
    show.set_defaults(func=lambda a: run_client_command(_show, a))

    rep = cmds.add_parser("report", help="write a self-contained HTML report of a job or a saved result file")
    rep.add_argument("job", metavar="JOB_OR_FILE", help="an eval job id, or an EvalResult JSON file (as `kiln eval run` saves one)")
    rep.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="HTML file to write (default report.html)")
    rep.set_defaults(func=_report_entry)

    cancel = cmds.add_parser("cancel", help="cancel a queued/running job, or delete a finished one")
    cancel.add_argument("job", help="an eval job id")
    cancel.set_defaults(func=lambda a: run_client_command(_cancel, a))

    rerun = cmds.add_parser("rerun", help="re-run a job's failing examples")
    rerun.add_argument("job", help="an eval job id")
    rerun.add_argument("--adapter", help="run them on this adapter (default: the job's first; \"\" = base)")
    rerun.add_argument("--seed", help="job seed (default: the original job's)")
    rerun.add_argument("--kinds", nargs="+", choices=["pass", "fail", "invalid", "error"],
                       help="which outcomes to re-run (default: fail invalid error)")
    rerun.add_argument("--include-pass", action="store_true", help="re-run the passing examples too")
    rerun.add_argument("--no-follow", action="store_true", help="submit and print the job id without waiting")
    rerun.add_argument("--json", action="store_true", help="print the EvalResult JSON instead of tables")
    rerun.set_defaults(func=lambda a: run_client_command(_rerun, a))

    replay = cmds.add_parser("replay", help="strictly replay a completed run and report matched/mismatch")
    replay.add_argument("job", help="a completed eval job id")
    replay.add_argument("--run-index", type=int, default=0, help="which run of the job to replay (default 0)")
    replay.add_argument("--no-follow", action="store_true", help="submit and print the job id without waiting")
    replay.add_argument("--json", action="store_true", help="print the EvalResult JSON instead of tables")
    replay.set_defaults(func=lambda a: run_client_command(_replay, a))

    for parser in (run, cmp, jobs, show, rep, cancel, rerun, replay):
        add_url_argument(parser)



def _seed(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


# ---- output ---------------------------------------------------------------------------------------

def _table(title: str, rows: list[dict[str, str]]) -> Table | None:
    if not rows:
        return None
    table = Table(title=title, title_justify="left")
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*row.values())
    return table


def print_summary(console: Console, result: dict[str, Any]) -> None:
    from kiln.evals.compare import adapter_label, compare_runs
    from kiln.evals.summary import run_row, scorer_rows, tag_rows

    runs = result.get("runs", [])
    console.print(f"[bold]{result.get('job_id')}[/bold]: {result.get('state')}"
                  + (f"  (seed {result['effective_seed']})" if result.get("effective_seed") else ""))
    tables = [_table("Runs", [run_row(i, r) for i, r in enumerate(runs)])]
    for i, run in enumerate(runs):
        label = f"run {i} ({adapter_label(run.get('adapter'))})"
        tables += [_table(f"Per tag, {label}", tag_rows(run)), _table(f"Per scorer, {label}", scorer_rows(run))]
    if len(runs) > 1:
        tables.append(_table("Paired comparison with run 0", [
            {"candidate": f"{c.candidate_run}: {c.candidate}", "paired": str(c.num_paired),
             "improved": str(c.improved), "regressed": str(c.regressed), "both pass": str(c.both_pass),
             "both fail": str(c.both_fail), "sign test p": f"{c.p_value:.4g}",
             "significant": "yes" if c.significant else "no"} for c in compare_runs(runs)]))
    for table in tables:
        if table is not None:
            console.print(table)
    if result.get("replay_verdict"):
        v = result["replay_verdict"]
        console.print(f"replay verdict: [bold]{v['status']}[/bold] - {v['message']}")
    if result.get("error"):
        console.print(f"[red]error:[/red] {result['error']}")


def _finish(args, result: dict[str, Any]) -> int:
    if getattr(args, "save", None):
        args.save.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print_summary(table_console(), result)
    return 0 if result.get("state") == "completed" else 1


# ---- following a server job -----------------------------------------------------------------------

def follow(client: ServerClient, job_id: str, *, quiet: bool = False) -> dict[str, Any]:
    """Poll the job until it is terminal, drawing progress; Ctrl-C cancels it and keeps following."""
    console = Console(stderr=True, quiet=quiet)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("acc {task.fields[acc]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(job_id, total=None, acc="-")
        cancelled = False
        while True:
            try:
                result = client.get(f"/v1/eval/jobs/{path_segment(job_id)}")
                if result["state"] in TERMINAL and (result["state"] != "cancelled" or _settled(client, job_id)):
                    return result
                p = result.get("progress")
                if p:
                    desc = f"{job_id} run {len(result['runs']) + 1}" if result["state"] == "running" else \
                        f"{job_id} {result['state']}"
                    progress.update(task, description=desc, total=p["examples_total"] or None,
                                    completed=p["examples_completed"], acc=f"{100 * p['running_accuracy']:.1f}%")
                time.sleep(POLL_SECONDS)
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                console.print(f"cancelling {job_id} (Ctrl-C again to stop waiting)")
                client.delete(f"/v1/eval/jobs/{path_segment(job_id)}")


def _settled(client: ServerClient, job_id: str) -> bool:
    """A cancelled job is settled once the worker has stamped its finish time."""
    jobs = client.get("/v1/eval/jobs")["jobs"]
    info = next((j for j in jobs if j["job_id"] == job_id), None)
    return info is None or info.get("finished_at_iso") is not None


def _submitted(client: ServerClient, args, receipt: dict[str, Any]) -> int:
    print(f"{receipt['message']}: job {receipt['job_id']} (seed {receipt['effective_seed']})", file=sys.stderr)
    if args.no_follow:
        print(receipt["job_id"])
        return 0
    return _finish(args, follow(client, receipt["job_id"], quiet=args.json))


# ---- commands -------------------------------------------------------------------------------------

def _run_entry(args) -> int:
    if args.base_url:
        try:
            return asyncio.run(_run_remote(args))
        except KilnError as e:
            print(f"error [{e.code}]: {e.message}", file=sys.stderr)
            return 1
        except ServerError as e:
            e.print()
            return 1
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"error: cannot run against {args.base_url}: {e}", file=sys.stderr)
            return 1
    return run_client_command(_run_server, args)


def _suite_body(arg: str) -> dict[str, Any]:
    from kiln.evals.suite_files import load_suite_data

    if Path(arg).exists():
        return {"inline_suite": load_suite_data(arg)}
    return {"suite": arg}


def _run_server(client: ServerClient, args) -> int:
    body = _suite_body(args.suite)
    if args.adapter is not None:
        body["adapter"] = args.adapter
    if args.seed is not None:
        body["seed"] = _seed(args.seed)
    return _submitted(client, args, client.post("/v1/eval/run", json=body))


async def _run_remote(args) -> int:
    from kiln.evals.jobs import EvalJob
    from kiln.evals.remote_generator import RemoteGenerator
    from kiln.evals.runner import RunPlan, run_suite
    from kiln.evals.seeds import effective_job_seed, parse_u64
    from kiln.evals.suite import parse_suite

    body = _suite_body(args.suite)
    data = body.get("inline_suite") or ServerClient(args.url).get(f"/v1/eval/suites/{path_segment(body['suite'])}")
    suite = parse_suite(data)
    seed = effective_job_seed(parse_u64(args.seed) if args.seed is not None else None, suite.generation.seed)
    adapter = args.adapter or None
    job = EvalJob("local-" + str(int(time.time())), suite, [adapter], "on_demand", seed)
    generator = RemoteGenerator(args.base_url, model=args.model, api_key=args.api_key, concurrency=args.concurrency)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, stop.set)
    console = Console(stderr=True, quiet=args.json)
    try:
        identity = await generator.identity()
        job.execution_provenance, job.base_weight_manifest = identity.execution_provenance, identity.base_weight_manifest
        job.state, job.started_at = "running", job.submitted_at
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("acc {task.fields[acc]}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"{suite.name} @ {args.base_url}", total=len(suite.examples), acc="-")

            def on_progress(p) -> None:
                progress.update(task, completed=p.examples_completed, acc=f"{100 * p.running_accuracy:.1f}%")

            plan = RunPlan(suite=suite, effective_seed=seed, adapter=adapter,
                           model_target={"adapter": adapter} if adapter else {})
            outcome = await run_suite(plan, generator, identity, stop=stop, on_progress=on_progress)
        job.runs.append(outcome.suite_result)
        job.state = "cancelled" if outcome.cancelled else "completed"
    finally:
        await generator.aclose()
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGINT)
    job.finished_at = job.runs[-1]["finished_at"] if job.runs else None
    return _finish(args, job.result())


def _compare(client: ServerClient, args) -> int:
    body: dict[str, Any] = {"suite": args.suite, "adapters": list(args.adapters)}
    if args.seed is not None:
        body["seed"] = _seed(args.seed)
    return _submitted(client, args, client.post("/v1/eval/compare", json=body))


def _rerun(client: ServerClient, args) -> int:
    body: dict[str, Any] = {"include_pass": args.include_pass}
    if args.adapter is not None:
        body["adapter"] = args.adapter
    if args.seed is not None:
        body["seed"] = _seed(args.seed)
    if args.kinds:
        body["outcome_kinds"] = args.kinds
    return _submitted(client, args, client.post(f"/v1/eval/jobs/{path_segment(args.job)}/rerun", json=body))


def _replay(client: ServerClient, args) -> int:
    receipt = client.post(f"/v1/eval/jobs/{path_segment(args.job)}/replay", json={"run_index": args.run_index})
    status = _submitted(client, args, receipt)
    if args.no_follow:
        return status
    verdict = client.get(f"/v1/eval/jobs/{path_segment(receipt['job_id'])}").get("replay_verdict") or {}
    return 0 if verdict.get("status") == "matched" else 1


def _jobs(client: ServerClient, args) -> int:
    body = client.get("/v1/eval/jobs")
    if printed_json(args, body):
        return 0
    table = Table(title="Eval jobs (newest first)", title_justify="left")
    table.add_column("job", no_wrap=True)
    for col in ("suite", "adapters", "state", "done", "acc", "submitted"):
        table.add_column(col)
    for j in body["jobs"]:
        p = j["progress"]
        acc = j["headline_accuracy"]
        kind = " (compare)" if j["submission_kind"] == "compare" else ""
        table.add_row(j["job_id"], j["suite_name"], ", ".join(a or "<base>" for a in j["adapters"]) + kind,
                      j["state"], f"{p['examples_completed']}/{p['examples_total']}",
                      "-" if acc is None else f"{100 * acc:.1f}%", j["submitted_at_iso"][:19].replace("T", " "))
    table_console().print(table)
    return 0


def _show(client: ServerClient, args) -> int:
    result = client.get(f"/v1/eval/jobs/{path_segment(args.job)}")
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print_summary(table_console(), result)
    return 0


def _cancel(client: ServerClient, args) -> int:
    body = client.delete(f"/v1/eval/jobs/{path_segment(args.job)}")
    print(f"{body['job_id']}: {body['status']}" + (f" ({body['note']})" if "note" in body else ""))
    return 0


def _report_entry(args) -> int:
    from kiln.evals.report import ReportDependencyError, render_report, require_matplotlib

    try:
        require_matplotlib()
    except ReportDependencyError as e:
        print(f"kiln eval report: {e}", file=sys.stderr)
        return 1

    path = Path(args.job)
    if path.is_file():
        result = json.loads(path.read_text(encoding="utf-8"))
    else:
        try:
            result = ServerClient(args.url).get(f"/v1/eval/jobs/{path_segment(args.job)}")
        except ServerError as e:
            e.print()
            return 1
    args.output.write_text(render_report(result), encoding="utf-8")
    print(f"wrote {args.output} ({len(result.get('runs', []))} run(s))")
    return 0
