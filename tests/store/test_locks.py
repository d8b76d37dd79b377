from __future__ import annotations

import subprocess
import sys
import threading
import time

from kiln.store.locks import resource_lock


def test_exclusive_lock_serialises_threads(tmp_path):
    events: list[str] = []
    entered = threading.Event()

    def holder():
        with resource_lock(tmp_path, "ds"):
            entered.set()
            events.append("first-in")
            time.sleep(0.2)
            events.append("first-out")

    t = threading.Thread(target=holder)
    t.start()
    entered.wait()
    with resource_lock(tmp_path, "ds"):
        events.append("second-in")
    t.join()
    assert events == ["first-in", "first-out", "second-in"]


def test_shared_locks_admit_readers_together(tmp_path):
    with resource_lock(tmp_path, "ds", shared=True), resource_lock(tmp_path, "ds", shared=True):
        pass


def test_locks_of_different_names_are_independent(tmp_path):
    with resource_lock(tmp_path, "a"), resource_lock(tmp_path, "b"):
        pass


def test_lock_excludes_another_process(tmp_path):
    code = (
        "import sys, time\n"
        "from kiln.store.locks import resource_lock\n"
        f"with resource_lock({str(tmp_path)!r}, 'ds'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(0.3)\n"
        f"    open({str(tmp_path / 'done')!r}, 'w').close()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with resource_lock(tmp_path, "ds"):
        assert (tmp_path / "done").exists()  # we got in only after the child finished its critical section
    proc.wait()


def test_a_non_blocking_attempt_reports_a_held_lock(tmp_path):
    with resource_lock(tmp_path, "ds"), resource_lock(tmp_path, "ds", blocking=False) as held:
        assert held is False
    with resource_lock(tmp_path, "ds", blocking=False) as held:
        assert held is True
