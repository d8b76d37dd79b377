"""Crash-test writer for the request log: appends rows forever, printing ACK once a row is durable.

`ACK <id>` is printed only after `flush()` returned, i.e. after the row was written and fsynced.
Rotation is set tiny so kills also land mid-rotation and mid-compression.
Usage: python crash_request_log.py LOG_DIR SEED
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kiln.traffic.request_log import RequestLog  # noqa: E402


def main() -> None:
    root, seed = Path(sys.argv[1]), int(sys.argv[2])
    rnd = random.Random(seed)
    rlog = RequestLog(root, max_file_bytes=64 * 1024, max_total_bytes=1 << 40, compress=True)
    for i in range(10**9):
        batch = [f"{seed}-{i}-{j}" for j in range(rnd.randint(1, 4))]
        for row_id in batch:
            rlog.write({"id": row_id, "messages": [{"role": "user", "content": "q" * rnd.randint(1, 3000)}],
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a" * 50}}]})
        if rlog.flush():
            print("ACK", *batch, flush=True)


if __name__ == "__main__":
    main()
