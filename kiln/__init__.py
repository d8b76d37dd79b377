"""Kiln: serve a language model over the OpenAI API and make it better while it serves."""

import os

__version__ = "0.1.0"

# OpenMP's workers (torch's intra-op threads) spin after each parallel region, by default for about
# 300k iterations. On a small CPU they then compete for the cores with the C++ kernels' own pool,
# which a decode step uses next; sleeping at once instead (OMP_WAIT_POLICY=PASSIVE) makes torch's
# own small GEMMs pay a wake-up each. A short spin suits both. Measured on 2 cores (ms per step,
# default / passive / 10k): quantized single stream 7.8 / 6.1 / 5.4, dense bf16 32.7 / 42.3 / 31.5;
# prefill 940 / 1060 / 1230 tok/s. libgomp reads it once, when torch loads it, so it is set here,
# before anything of Kiln imports torch; a value the user set (or OMP_WAIT_POLICY) wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
