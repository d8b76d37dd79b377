"""The durable request log: rows survive, files rotate and compress, retention caps the directory,
a torn tail is tolerated, writes never block, and a SIGKILL never costs an acknowledged row."""

from __future__ import annotations

import gzip
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.traffic.request_log import ACTIVE, RequestLog, enforce_retention, log_files, read_rows, recover

WRITER = Path(__file__).with_name("crash_request_log.py")


def row(i: int, size: int = 10) -> dict:
    return {"id": f"chatcmpl-{i}", "messages": [{"role": "user", "content": "x" * size}]}


def test_rows_written_then_flushed_are_read_back_in_order(tmp_path):
    rlog = RequestLog(tmp_path)
    for i in range(5):
        assert rlog.write(row(i))
    assert rlog.flush()
    assert [r["id"] for r in read_rows(tmp_path)] == [f"chatcmpl-{i}" for i in range(5)]
    rlog.close()


def test_close_writes_what_is_queued_and_later_writes_are_dropped(tmp_path):
    rlog = RequestLog(tmp_path)
    rlog.write(row(1))
    rlog.close()
    rlog.close()  # idempotent: shutdown may call it twice
    assert rlog.write(row(2)) is False
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-1"]
    assert rlog.stats.dropped == 1


def test_size_rotation_compresses_and_keeps_every_row(tmp_path):
    rlog = RequestLog(tmp_path, max_file_bytes=2000, compress=True)
    for i in range(60):
        rlog.write(row(i, 100))
        rlog.flush()
    rlog.close()
    files = log_files(tmp_path)
    assert files[-1].name == ACTIVE
    assert len(files) > 2 and all(f.name.endswith(".jsonl.gz") for f in files[:-1])
    json.loads(gzip.decompress(files[0].read_bytes()).split(b"\n")[0])
    assert [r["id"] for r in read_rows(tmp_path)] == [f"chatcmpl-{i}" for i in range(60)]


def test_retention_deletes_the_oldest_rotated_files_first(tmp_path):
    rlog = RequestLog(tmp_path, max_file_bytes=1500, max_total_bytes=4000, compress=False)
    for i in range(100):
        rlog.write(row(i, 100))
        rlog.flush()
    rlog.close()
    total = sum(f.stat().st_size for f in log_files(tmp_path))
    assert total <= 4000 + 1500
    ids = [int(r["id"].split("-")[1]) for r in read_rows(tmp_path)]
    assert ids == list(range(ids[0], 100)) and ids[0] > 0   # a contiguous, newest suffix survives


def test_a_row_over_the_capture_cap_is_kept_without_its_bodies(tmp_path):
    rlog = RequestLog(tmp_path, max_row_bytes=500)
    rlog.write({**row(1, 2000), "status": "ok"})
    rlog.close()
    (got,) = list(read_rows(tmp_path))
    assert got["truncated"] is True and "messages" not in got and got["status"] == "ok"
    assert got["original_bytes"] > 2000


def test_a_full_queue_drops_rows_instead_of_blocking(tmp_path, monkeypatch):
    rlog = RequestLog(tmp_path, queue_rows=2)
    gate = __import__("threading").Event()
    original = rlog._append
    monkeypatch.setattr(rlog, "_append", lambda r: (gate.wait(), original(r)))
    results = [rlog.write(row(i)) for i in range(10)]   # returns at once although the disk "hangs"
    assert results.count(False) >= 5 and rlog.stats.dropped == results.count(False)
    gate.set()
    rlog.close()


def test_an_unwritable_row_is_counted_and_the_log_goes_on(tmp_path):
    rlog = RequestLog(tmp_path)
    rlog.write({"id": "bad", "value": object()})
    rlog.write(row(2))
    rlog.close()
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-2"] and rlog.stats.errors == 1


def test_find_returns_a_row_by_id_from_rotated_and_current_files(tmp_path):
    rlog = RequestLog(tmp_path, max_file_bytes=1000)
    for i in range(30):
        rlog.write(row(i, 100))
    rlog.flush()
    assert rlog.find("chatcmpl-0")["id"] == "chatcmpl-0"
    assert rlog.find("chatcmpl-29")["id"] == "chatcmpl-29"
    assert rlog.find("chatcmpl-99") is None
    rlog.close()


def test_reading_tolerates_a_torn_tail_and_the_next_start_cuts_it(tmp_path):
    whole = json.dumps(row(1)) + "\n"
    (tmp_path / ACTIVE).write_text(whole + '{"id": "chatcmpl-2", "mess')
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-1"]
    rlog = RequestLog(tmp_path)
    assert (tmp_path / ACTIVE).read_text() == whole
    rlog.write(row(3))
    rlog.close()
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-1", "chatcmpl-3"]


def test_recovery_after_a_kill_mid_compression_keeps_one_copy(tmp_path):
    plain = tmp_path / "requests-20260101T000000000000Z.jsonl"
    plain.write_text(json.dumps(row(1)) + "\n")
    (tmp_path / (plain.name + ".gz.tmp")).write_bytes(b"\x1f\x8b partial")
    recover(tmp_path, compress=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [plain.name + ".gz"]
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-1"]
    # killed after the gzip was renamed in but before the plain copy went: the reader takes one copy
    plain.write_text(json.dumps(row(1)) + "\n")
    assert [r["id"] for r in read_rows(tmp_path)] == ["chatcmpl-1"]
    recover(tmp_path, compress=False)
    assert not plain.exists()


def test_retention_never_deletes_the_current_file(tmp_path):
    (tmp_path / ACTIVE).write_text("x" * 100)
    assert enforce_retention(tmp_path, 10) == []
    assert (tmp_path / ACTIVE).exists()


def test_sigkill_mid_write_keeps_every_acknowledged_row(tmp_path):
    rnd = random.Random(7)
    acked: list[str] = []
    for seed in range(5):
        proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path), str(seed)], stdout=subprocess.PIPE)
        first = proc.stdout.readline()   # started and writing (a loaded machine may take a while to get here)
        time.sleep(rnd.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        for line in (first + out).decode().split("\n")[:-1]:   # the last piece may be half-printed
            kind, *ids = line.split()
            if kind == "ACK":
                acked.extend(ids)
        rows = list(read_rows(tmp_path))          # parses whatever the kill left
        ids = [r["id"] for r in rows]
        assert set(acked) <= set(ids), "an acknowledged row was lost"
        assert len(ids) == len(set(ids)), "a row was duplicated by an interrupted rotation"
    assert len(acked) > 50, "the writer never got far enough to test anything"
    assert any(f.name.endswith(".gz") for f in log_files(tmp_path)), "no rotation happened"
