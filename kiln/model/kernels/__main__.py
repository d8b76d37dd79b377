"""`python -m kiln.model.kernels`: build (or find cached) the C++ kernels now, so no server or test
waits for the compiler later. A failure is reported, not fatal: every kernel has a torch fallback."""

from __future__ import annotations

import logging
import sys
import time

from kiln.model import kernels


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    if kernels.load() is None:
        print(f"kiln kernels unavailable ({kernels.load_error()}); the torch fallbacks will be used", file=sys.stderr)
        return 0
    print(f"kiln kernels ready ({kernels.best_isa()}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
