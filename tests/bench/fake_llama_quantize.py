#!/usr/bin/env python3
"""A FAKE llama-quantize for the plumbing tests of `kiln bench --synthetic` (tests/bench/
test_synthetic_models.py): it takes llama-quantize's arguments (IN OUT TYPE [NTHREADS]), appends them
to $FAKE_QUANTIZE_LOG, and copies IN to OUT with the TYPE name prepended, or exits 1 with a message
when $FAKE_QUANTIZE_FAIL is set (after writing half a file, as a crashed quantizer would). It quantizes
nothing: the real llama-quantize is tested where it is built."""

import os
import sys

src, out, kind = sys.argv[1:4]
with open(os.environ["FAKE_QUANTIZE_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
with open(src, "rb") as f, open(out, "wb") as g:
    g.write(kind.encode() + b"\n")
    if os.environ.get("FAKE_QUANTIZE_FAIL"):
        print("fake llama-quantize: failed on purpose", file=sys.stderr)
        sys.exit(1)
    g.write(f.read())
