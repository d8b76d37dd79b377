"""Start-to-ready of a server: launch it, poll `GET /health` every 20 ms until it answers 200, and report
the time that took, the CPU time the process spent by then, and its resident set at ready and some
seconds later (what the background work after ready, e.g. the training imports, adds).

    .venv/bin/python benchmarks/startup.py MODEL.gguf [--runs 3] [--after 10] [--port 8431]
    .venv/bin/python benchmarks/startup.py MODEL.gguf --llama-server /path/llama-server

Without --llama-server it runs `python -m kiln.cli serve MODEL` (with this interpreter, so PYTHONPATH
picks the checkout). Other jobs on the machine slow every figure down: the best of several runs is
the figure to compare; the load average before each run is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 0.02


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def run_once(cmd: list[str], port: int, after_s: float, timeout_s: float, log: Path) -> dict[str, float]:
    load = os.getloadavg()
    url = f"http://127.0.0.1:{port}/health"
    with log.open("w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}) before ready; see {log}")
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"not ready after {timeout_s:.0f} s; see {log}")
                time.sleep(POLL_S)
            ready = time.perf_counter() - t0
            res = {"ready_s": ready, "cpu_at_ready_s": _cpu_s(proc.pid), "rss_ready_mb": _rss_mb(proc.pid),
                   "peak_ready_mb": _peak_mb(proc.pid), "load1": load[0]}
            time.sleep(after_s)
            res.update(rss_after_mb=_rss_mb(proc.pid), peak_after_mb=_peak_mb(proc.pid),
                       cpu_after_s=_cpu_s(proc.pid))
            return res
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--after", type=float, default=10.0, help="seconds after ready to read the RSS again")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--llama-server", help="measure this llama-server binary instead of Kiln")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    ap.add_argument("--log", default="/tmp/startup-server.log")
    ap.add_argument("extra", nargs="*", help="more arguments for the server (after --)")
    args = ap.parse_args()
    if args.llama_server:
        cmd = [args.llama_server, "-m", args.model, "--port", str(args.port), "-t", str(args.threads), *args.extra]
    else:
        cmd = [sys.executable, "-m", "kiln.cli", "serve", args.model, "--port", str(args.port), *args.extra]
    print(" ".join(cmd))
    best: dict[str, float] | None = None
    for i in range(args.runs):
        r = run_once(cmd, args.port, args.after, args.timeout, Path(args.log))
        print(f"run {i + 1}: ready {r['ready_s']:.2f} s (CPU {r['cpu_at_ready_s']:.2f} s), RSS at ready "
              f"{r['rss_ready_mb']:.0f} MB (peak {r['peak_ready_mb']:.0f}), {args.after:.0f} s later "
              f"{r['rss_after_mb']:.0f} MB (peak {r['peak_after_mb']:.0f}, CPU {r['cpu_after_s']:.2f} s); "
              f"load average before {r['load1']:.2f}", flush=True)
        if best is None or r["ready_s"] < best["ready_s"]:
            best = r
    assert best is not None
    print(f"best: ready {best['ready_s']:.2f} s, RSS at ready {best['rss_ready_mb']:.0f} MB, "
          f"{args.after:.0f} s later {best['rss_after_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
