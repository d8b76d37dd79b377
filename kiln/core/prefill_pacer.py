"""How much prompt a step that carries decodes may prefill, learned from the steps this engine ran.

A fixed price per step (`prefill_cost_with_decodes`) bounds the decoding streams' inter-token gap on
the machine it was tuned on; on a slower code path (AVX2 without bfloat16 dot products, a bigger
model) the same price takes twice as long. The pacer instead aims every step that carries decodes at
a wall time (Sarathi-Serve's stall-free batching sizes its token budget from a time-between-tokens
target the same way). It fits two lines to the steps it is shown:
- decode-only steps: ms ~ a + b * decodes;
- steps with prompt chunks: what they took beyond their decodes ~ f + u * price, where price is
  prefill_cost.chunk_cost (a token's projections plus its attention to earlier positions) and f what
  carrying any chunk at all costs (a mixed step leaves the fused decode path).
A step of d decodes then aims at max(target_ms, min(DECODE_MULTIPLE x its decodes alone, its decodes
alone + PREFILL_SHARE_MS)): a few streams keep their gap near the target; many streams (or a machine
whose decodes alone are slow) stretch theirs by at most that multiple, so the streams' p99 gap stays
within it of their p50 while prompts still get in at a useful pace; and where the decodes alone are
slow (a 1B model) the prompt adds at most PREFILL_SHARE_MS to the gap instead of 1.5x the decodes.
While a queue of prompts waits for its first token (QUEUE_MIN of them: a burst of requests, not one
long prompt arriving among streams), a step aims higher, at QUEUE_MULTIPLE x that aim but no more than
QUEUE_AIM_MS, or QUEUE_FIXED_MULTIPLE x what a step costs before its rows where that is more: every
queued user is waiting too, and small chunks drain a queue at a fraction of the prefill speed (each
carries a step's fixed cost, on a big model mostly streaming its weights), so the queue gets what the
gap bound allows, and on a big model several times that fixed cost. The
price is what fits that time, but never so little that
the fixed cost f is more than half of the step's prefill share (a chunk that small wastes the step).
Until both lines have data the scheduler keeps the fixed price. A pacer made with
`below_fixed_price` only bounds the fixed price: the scheduler takes its price where it is the smaller
one (this machine runs the fixed price's chunks too slowly for its aim) and the fixed price elsewhere.

Exponentially weighted sums follow the machine as it changes (other load, deeper prompts pricing
their attention a little wrong); steps too small to tell from noise teach nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Prefill steps priced below this are mostly fixed per-step cost; they would skew the rate.
MIN_SAMPLE_PRICE = 8.0
# Weight of the newest step in each fitted line.
ALPHA = 0.25
# A step that carries decodes may take this many times what its decodes alone take (below 3, so
# paced gaps stay under 3x the decode-only ones however many of the gaps they are).
DECODE_MULTIPLE = 2.5
# Where the decodes alone are slow, a step's prompt chunks add at most this much to it: a 1B model's
# 8 decodes take 70-115 ms on a 2-core AMD EPYC Zen 4 with no other load (8 streams at 116 tok/s with
# Q4_1 blocks, 70 with dense bfloat16), and 2.5x that would come near a 300 ms gap.
PREFILL_SHARE_MS = 100.0
# This many prompts waiting for their first token make a queue (one is a lone arrival, paced gently).
QUEUE_MIN = 2
# While a queue waits a step aims at this multiple of its usual aim, at most QUEUE_AIM_MS: on a 1B
# model (2-core AMD EPYC Zen 4) 8 or 32 simultaneous requests were admitted 16-40 prompt tokens a
# step, ~5 ms a token against ~3.3 in whole prompts, so the first streams finished before the last
# ones started; 250 ms keeps the streams' gaps under a 300 ms bound.
QUEUE_MULTIPLE = 2.0
QUEUE_AIM_MS = 250.0
# ... or, where more, this many times what a step costs before its rows (`fixed_ms`: on a big model,
# streaming its weights). A 3B model's one-decode steps take 65-70 ms on a 2-core Zen 4: a 250 ms step
# there left a queue of 8 ~100-token requests 16 tokens a step, so the streams already decoding took
# their tokens a few rows at a time (~33 ms a token against 19 in 8-row decode steps) and the 8 streams
# ran at 16.4 tok/s in all. A 1B model's 25-30 ms keep the 250 ms bound.
QUEUE_FIXED_MULTIPLE = 6.0


@dataclass
class _Line:
    """y ~ a + b * x by exponentially weighted least squares."""
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - ALPHA
        self.w, self.x, self.y = keep * self.w + 1, keep * self.x + x, keep * self.y + y
        self.xx, self.xy = keep * self.xx + x * x, keep * self.xy + x * y

    def fit(self, min_spread: float, through_origin: bool) -> tuple[float, float] | None:
        """(a, b); while the x seen so far hardly vary, a flat line (or one through the origin)."""
        if self.w == 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < min_spread * min_spread:
            return (0.0, my / mx) if through_origin and mx > 0 else (my, 0.0)
        b = max(0.0, (self.xy / self.w - mx * my) / var)
        return max(0.0, my - b * mx), b


@dataclass
class PrefillPacer:
    target_ms: float                      # a step that carries decodes aims to take about this long
    below_fixed_price: bool = False       # only bound the fixed price (the scheduler takes the smaller)
    _decodes: _Line = field(default_factory=_Line)   # decode-only steps: ms by decode rows
    _prefill: _Line = field(default_factory=_Line)   # mixed steps: ms beyond the decodes, by price
    _one_decode_ms: float | None = None              # one-decode steps alone, exponentially weighted

    def __post_init__(self) -> None:
        if not self.target_ms > 0:
            raise ValueError(f"target_ms must be > 0, got {self.target_ms}")

    def decode_ms(self, decodes: int) -> float | None:
        """A step of `decodes` decodes alone, as measured so far (None before any)."""
        line = self._decodes.fit(0.5, through_origin=False)
        return None if line is None else line[0] + line[1] * decodes

    def prefill_ms(self, price: float) -> float | None:
        """What carrying prompt chunks of `price` adds to a step, as measured so far."""
        line = self._prefill.fit(MIN_SAMPLE_PRICE, through_origin=True)
        return None if line is None else line[0] + line[1] * price

    def observe(self, decodes: int, price: float, ms: float) -> None:
        """Learn from one finished step: its decode rows, the prefill price it carried, its wall time."""
        if ms < 0:
            return
        if price <= 0:
            if decodes > 0:
                self._decodes.add(decodes, ms)
            if decodes == 1:
                last = self._one_decode_ms
                self._one_decode_ms = ms if last is None else (1.0 - ALPHA) * last + ALPHA * ms
            return
        if price < MIN_SAMPLE_PRICE:
            return
        if decodes > 0:
            base = self.decode_ms(decodes)
            if base is None:
                return  # cannot tell the prefill's share from the decodes' yet
            ms -= base
        self._prefill.add(price, max(ms, 0.0))

    def price_budget(self, decodes: int, queued: int = 0) -> float | None:
        """The prefill price a step of `decodes` decodes may spend while `queued` prompts wait for
        their first token; None until both lines have data."""
        base = self.decode_ms(decodes)
        line = self._prefill.fit(MIN_SAMPLE_PRICE, through_origin=True)
        if base is None or line is None:
            return None
        fixed, per_price = line[0], max(line[1], 1e-6)
        return max(self.step_ms(base, queued) - base - fixed, fixed) / per_price

    def step_ms(self, decode_ms: float, queued: int = 0) -> float:
        """What a step whose decodes alone take `decode_ms` aims at, with `queued` prompts waiting."""
        aim = max(self.target_ms, min(DECODE_MULTIPLE * decode_ms, decode_ms + PREFILL_SHARE_MS))
        if queued >= QUEUE_MIN:
            aim = max(aim, min(QUEUE_MULTIPLE * aim, QUEUE_AIM_MS), QUEUE_FIXED_MULTIPLE * self.fixed_ms())
        return aim

    def fixed_ms(self) -> float:
        """About what a step costs before its rows: the recent one-decode steps' time (one row's own work
        is small beside streaming the weights; 0 before any). Not the decode line's intercept: while a
        burst is admitted the only decode-only steps are one-decode ones, and in a steady state of many
        streams all are equally wide, so that line often cannot tell a step's rows from its fixed cost."""
        return self._one_decode_ms or 0.0


@dataclass(frozen=True)
class ItlPacing:
    """How an engine sizes prompt chunks while decodes share a step."""
    target_ms: float                  # 0: the fixed price alone, no pacer
    below_fixed_price: bool = False   # the pacer only bounds the fixed price

    def pacer(self) -> PrefillPacer | None:
        return PrefillPacer(self.target_ms, self.below_fixed_price) if self.target_ms > 0 else None


# `engine.itl_target_ms = "auto"`: pace by time where the fixed price was measured to leave long gaps.
# The floor of the step's aim: below it a prompt's share of a step would be a sliver of its fixed
# cost; a 50 ms gap is 20 tokens a second, which a reader does not see as a hitch.
AUTO_TARGET_MS = 50.0
# Elsewhere on a CPU the fixed price stands while its steps would fit a pacer aiming at this (on
# SmolLM2-135M they took about 90 ms with 8 decodes on an AMD EPYC, AVX-512: benchmarks/README.md);
# a 1B model's take several times longer.
AUTO_BOUND_MS = 150.0


def auto_itl_pacing(device: str, dtype: str, quantization: str, cpu_isa: str | None) -> ItlPacing:
    """What "auto" stands for. AUTO_TARGET_MS for the float-arithmetic weights (dense bfloat16, or a
    GGUF's blocks with float32 activations, gguf-float) on a CPU whose kernels run AVX2 (or scalar)
    code; elsewhere on a CPU the fixed price, bounded by a pacer aiming at AUTO_BOUND_MS (it takes
    over where the fixed price's steps run longer); off a CPU the fixed price alone. A paced step aims
    at the larger of its target and DECODE_MULTIPLE x its decodes alone (their own time plus at most
    PREFILL_SHARE_MS), so the gaps follow the machine's own decode speed.

    Measured with `kiln bench --only itl` (8 streams, then a 2000-token prompt), dense AVX2: the fixed
    price left 310 ms (AMD EPYC) and 291 ms (Intel Xeon) gaps; a flat 150 ms target cut them to 195 /
    175 ms, but on the EPYC, whose 8 decodes take 28 ms, the paced steps were 5.4x the others and made
    p99/p50 6.5x; aiming at a multiple of the decodes keeps both in bounds on both machines
    (benchmarks/README.md). Elsewhere the fixed price was as good or better on SmolLM2-135M: AVX-512 on
    the EPYC 142 -> 286 ms; gguf on AVX2 174 -> 176 ms, where the paced prompt ends sooner and the
    decode-only steps after it make p99/p50 5.7x. gguf-float on AVX2 (AMD EPYC Zen 2), whose prefill
    and batched decode are float32 FMAs as dense AVX2's are: the fixed price left a 364 ms gap (p50
    180 ms), the paced steps 144 ms (p50 115 ms, p99/p50 1.20). On a Llama-3.2-1B-shaped Q4_K_M served
    with --quantization gguf (AMD EPYC Zen 4, AVX-512 VNNI) the fixed price left gaps of p50 283 ms,
    longest 588 ms (`kiln bench --synthetic 1b --quick`): a 100-token prompt arriving whole, and 64-unit
    chunks of a long one, each take several times their SmolLM2 time; there the bounding pacer takes
    over (benchmarks/README.md has the 1B figures)."""
    if device != "cpu":
        return ItlPacing(0.0)
    float_weights = (quantization == "none" and dtype == "bfloat16") or quantization == "gguf-float"
    if float_weights and cpu_isa in ("avx2", "scalar"):
        return ItlPacing(AUTO_TARGET_MS)
    return ItlPacing(AUTO_BOUND_MS, below_fixed_price=True)
