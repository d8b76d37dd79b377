"""Kiln's AdamW (kiln/train/optim.py) against torch.optim.AdamW: the same bits, the same state_dict, and
no torch._dynamo import."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from kiln.train.optim import AdamW


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # LoRA-like factors: an A [r, k] and a B [n, r] (zero at the start, as a fresh LoRA's B is)
    return [torch.nn.Parameter(torch.randn(8, 64, generator=g) * 0.1), torch.nn.Parameter(torch.zeros(48, 8))]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) * (10.0 ** (step % 5 - 3)) for p in params]


def _run(opt, params, steps: range) -> None:
    for s in steps:
        opt.zero_grad(set_to_none=True)
        for p, grad in zip(params, _grads(s, params), strict=True):
            if not (s % 4 == 3 and p is params[1]):   # now and then a parameter without a gradient
                p.grad = grad.clone()
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("lr", [1e-2, 2e-4])
def test_every_step_updates_the_parameters_to_torchs_bits(lr: float, weight_decay: float) -> None:
    ours, theirs = _params(), _params()
    a = AdamW(ours, lr=lr, weight_decay=weight_decay)
    b = torch.optim.AdamW(theirs, lr=lr, weight_decay=weight_decay)
    for s in range(12):
        _run(a, ours, range(s, s + 1))
        _run(b, theirs, range(s, s + 1))
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True)), f"step {s + 1}"


@pytest.mark.parametrize("direction", ["torch to kiln", "kiln to torch"])
def test_a_state_dict_resumes_in_either_optimizer_to_the_same_bits(direction: str) -> None:
    first, second = (torch.optim.AdamW, AdamW) if direction == "torch to kiln" else (AdamW, torch.optim.AdamW)
    straight, resumed = _params(), _params()
    opt = torch.optim.AdamW(straight, lr=1e-2, weight_decay=0.01)
    _run(opt, straight, range(10))
    before = first(resumed, lr=1e-2, weight_decay=0.01)
    _run(before, resumed, range(5))
    saved = before.state_dict()
    # a checkpoint's round trip: torch.save / torch.load
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    after = second(resumed, lr=0.5, weight_decay=0.0)   # the saved settings win, as torch's do
    after.load_state_dict(torch.load(buf, weights_only=True))
    _run(after, resumed, range(5, 10))
    assert all(torch.equal(x, y) for x, y in zip(straight, resumed, strict=True))


def test_the_state_dict_has_torchs_layout() -> None:
    ours, theirs = _params(), _params()
    a, b = AdamW(ours, lr=1e-3, weight_decay=0.1), torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.1)
    _run(a, ours, range(3))
    _run(b, theirs, range(3))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            x, y = sa["state"][i][k], sb["state"][i][k]
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)


def test_building_and_stepping_it_imports_no_compiler() -> None:
    code = ("import sys, torch; from kiln.train.optim import AdamW; p = torch.nn.Parameter(torch.ones(3)); "
            "o = AdamW([p], lr=0.1); p.grad = torch.ones(3); o.step(); o.load_state_dict(o.state_dict()); "
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"
