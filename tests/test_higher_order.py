"""A second derivative through a rewritten region raises where it is requested, on every path.

The tiles' backward is exact to first order only. Under a compiled backend the check in the ops'
backward runs while AOTAutograd traces it (grad mode off), so it used to be skipped and the
second derivative came back as ``None``/zero without an error (100% off against float64 eager).
Every case here asks for it through ``create_graph=True`` and must get the documented error, and
the first derivatives of the same step must equal float64 eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tile_pass

N, H, V = 12, 8, 40
SECOND = "second derivative through the tiled loss"


def _inputs(bias: bool):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[::4] = -100
    return h, w, b, y


def _loss_fn(reduction):
    def loss(h, w, b, y):
        return F.cross_entropy(F.linear(h, w, b), y, reduction=reduction)

    return loss


def _custom_inner(gm, example_inputs):
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _compiled(how: str, fn):
    if how == "decorator":
        return tile_pass.tiled_loss(fn, inner="aot_eager", tile_tokens=4)
    inner = _custom_inner if how == "custom inner" else how
    backend = tile_pass.backend(inner, tile_tokens=4)
    return torch.compile(fn, backend=backend)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("how", ["eager", "aot_eager", "custom inner", "decorator"])
def test_second_derivative_raises_under_every_backend(how, reduction, bias):
    fn = _loss_fn(reduction)
    compiled = _compiled(how, fn)
    h, w, b, y = _inputs(bias)
    wrt = [t for t in (h, w, b) if t is not None]
    loss = compiled(h, w, b, y)
    with pytest.raises(RuntimeError, match=SECOND):
        torch.autograd.grad(loss, wrt, create_graph=True)
    for only in wrt:  # a request for one input alone must not come back as None either
        with pytest.raises(RuntimeError, match=SECOND):
            torch.autograd.grad(compiled(h, w, b, y), only, create_graph=True)
    # first derivatives of the same compiled step are float64 eager's
    got = torch.autograd.grad(compiled(h, w, b, y), wrt)
    expected = torch.autograd.grad(fn(h, w, b, y), wrt)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_second_derivative_raises_under_inductor():
    fn = _loss_fn("mean")
    backend = tile_pass.backend("inductor", tile_tokens=4)
    compiled = torch.compile(fn, backend=backend)
    h, w, b, y = _inputs(True)
    loss = compiled(h, w, b, y)
    assert backend.report().rewrites
    with pytest.raises(RuntimeError, match=SECOND):
        torch.autograd.grad(loss, (h, w, b), create_graph=True)


def test_second_derivative_through_a_row_wise_region_raises():
    def z_loss(h, w, b, y):
        logits = F.linear(h, w, b)
        return F.cross_entropy(logits, y) + 1e-2 * logits.logsumexp(-1).pow(2).mean()

    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    h, w, b, y = _inputs(False)
    loss = torch.compile(z_loss, backend=backend)(h, w, b, y)
    assert backend.report().rewrites
    with pytest.raises(RuntimeError, match=SECOND):
        torch.autograd.grad(loss, h, create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_functional_api_inside_a_plain_torch_compile_raises(reduction):
    """No tile_pass backend to guard the outputs: AOTAutograd's own double-backward error must be
    reached (the scalar op saves its inputs as anchors while traced), never a silent None."""
    h, w, _, y = _inputs(False)

    def step(h, w):
        return tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4, reduction=reduction).sum()

    compiled = torch.compile(step, backend="aot_eager")
    for wrt in ((h, w), (h,), (w,)):
        grads = torch.autograd.grad(compiled(h, w), wrt, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward|second derivative"):
            torch.autograd.grad(sum((g * g).sum() for g in grads), wrt, allow_unused=True)
