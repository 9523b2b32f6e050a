"""The exactness matrix through the compiled path, under every inner compiler.

One compiled function per (inner, reduction, dtype) serves every label pattern: the
patterns change label values only, so nothing recompiles between them.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEVICES,
    assert_close_to_oracle,
    assert_no_worse_than_eager,
    leaves,
    value_and_grads,
)
from test_tiled_loss import PATTERNS, make_inputs, masked_target

import tile_pass

pytestmark = pytest.mark.shares_compiled


@pytest.fixture(scope="module", autouse=True)
def _room_for_every_variant():
    """All variants compile the same code object (``head``): allow one cache entry each."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield
    torch._dynamo.reset()


N, H, V, TILE = 37, 16, 29, 8  # 5 tiles, the last one shorter


def head(reduction, hidden, weight, bias, target):
    logits = F.linear(hidden, weight, bias).float()
    loss = F.cross_entropy(logits.view(-1, V), target.view(-1), reduction=reduction, label_smoothing=0.1)
    return loss * 3.7 if reduction != "none" else loss  # non-unit upstream gradient


@functools.cache
def compiled(inner, reduction, device, dtype):
    backend = tile_pass.backend(inner, tile_tokens=TILE)
    fn = functools.partial(head, reduction)
    return torch.compile(fn, backend=backend), backend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_compiled_matrix(pattern, reduction, inner, dtype, device):
    if dtype == torch.bfloat16 and inner == "inductor" and device == "cpu" and pattern != "uneven":
        pytest.skip("bf16 x inductor on CPU: one representative pattern keeps the run short")
    hidden, weight, bias = make_inputs(N, H, V, device, bias=True)
    target = masked_target(N, V, pattern, tile=TILE).to(device)
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(N, generator=g, dtype=torch.float64).to(device) if reduction == "none" else None
    fn, backend = compiled(inner, reduction, device, dtype)
    oracle, oracle_grads = value_and_grads(
        lambda a, w, b: head(reduction, a, w, b, target), leaves(hidden, weight, bias), upstream
    )
    out, grads = value_and_grads(
        lambda a, w, b: fn(a, w, b, target), leaves(hidden, weight, bias, dtype=dtype), upstream
    )
    assert len(backend.report().rewrites) == 1
    assert out.dtype == torch.float32
    if dtype == torch.float32:
        assert_close_to_oracle(out, oracle, dtype, "loss")
        for name, g, rg in zip(("hidden", "weight", "bias"), grads, oracle_grads, strict=True):
            assert g.dtype == dtype
            assert_close_to_oracle(g, rg, dtype, f"grad {name}")
        return
    eager, eager_grads = value_and_grads(
        lambda a, w, b: head(reduction, a, w, b, target),
        leaves(hidden, weight, bias, dtype=dtype),
        upstream,
    )
    names = ("loss", "grad hidden", "grad weight", "grad bias")
    for name, t, e, o in zip(
        names, [out, *grads], [eager, *eager_grads], [oracle, *oracle_grads], strict=True
    ):
        assert t.dtype == e.dtype, name
        assert_no_worse_than_eager(t, e, o, name)
