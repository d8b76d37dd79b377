"""Random GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) for tests: every byte random except the float16
factors, which are small finite numbers (any code and scale byte is a valid block)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

GGUF_TYPES = {"q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
              "q6_k": GGMLQuantizationType.Q6_K}
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def random_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """GGUF blocks `[n * k / 256, block bytes]` (uint8) of a random `[n, k]` tensor of `kind`."""
    rng = np.random.default_rng(seed)
    nb = n * (k // 256)
    b = rng.integers(0, 256, size=(nb, BLOCK_BYTES[kind]), dtype=np.uint8)

    def f16() -> np.ndarray:
        return (rng.standard_normal(nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if kind == "q6_k":
        b[:, 208:210] = f16()
    else:
        b[:, 0:2], b[:, 2:4] = f16(), np.abs(f16().view(np.float16)).view(np.uint8)
    return b
