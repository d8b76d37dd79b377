"""Kiln: serve a language model over the OpenAI API and make it better while it serves."""

import os

__version__ = "0.1.0"

# OpenMP's workers (torch's intra-op threads) spin for a while after each parallel region. On a
# small CPU they then compete for the cores with the C++ kernels' own pool, which a decode step uses
# next: measured on 2 cores, a single-stream step took 7.8 ms with spinning workers and 5.3 ms with
# sleeping ones, an 8-stream step 20 vs 15 ms, and prefill was faster too. libgomp reads the setting
# once, when torch loads it, so it is set here, before anything of Kiln imports torch; a value the
# user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
