"""Shared helpers: devices, the float64 eager oracle, and gradient comparison."""

from __future__ import annotations

import os

# the project's own tests see every internal error of the pass (it is read when tile_pass is imported)
os.environ.setdefault("TILE_PASS_STRICT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import tile_pass  # noqa: E402

try:  # installed: the entry point names the backend; from a source tree (offline GPU machines) it does not
    torch._dynamo.lookup_backend("tile_pass")
except torch._dynamo.exc.InvalidBackend:
    torch._dynamo.register_backend(tile_pass.tile_pass_backend, name="tile_pass")

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device")),
]

# Tolerances against the float64 oracle, relative to the oracle's magnitude.
# float32: a few ulps of accumulated rounding. bfloat16: 8 bits of mantissa; tiles round
# their partial gradients once each, like eager rounds the whole-matrix result once.
TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=2e-6),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-3),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles from scratch, except those that share compiled functions on purpose."""
    if request.node.get_closest_marker("shares_compiled"):
        yield
        return
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fx_tracing_state_is_restored():
    """A test that leaves FX's global "is tracing" flag set fails every later compile in the
    process; failing here names the test that left it."""
    yield
    assert not torch.fx._symbolic_trace.is_fx_tracing(), "FX's tracing flag was left set"


def leaves(*tensors, requires_grad=True, dtype=None):
    """Detached copies (optionally cast) that require grad; ``None`` passes through."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        c = t.detach().clone()
        if dtype is not None and c.is_floating_point():
            c = c.to(dtype)
        out.append(c.requires_grad_(requires_grad and c.is_floating_point()))
    return out


def value_and_grads(fn, inputs, upstream=None):
    """``fn(*inputs)`` and the gradients of every input that requires grad (else None)."""
    out = fn(*inputs)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if upstream is None:
        upstream = torch.ones_like(out)
    grads = torch.autograd.grad(out, wanted, upstream.to(out.dtype)) if wanted else []
    it = iter(grads)
    return out, [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


def assert_close_to_oracle(actual, oracle, dtype, what=""):
    tol = TOLERANCES[dtype]
    scale = oracle.detach().abs().max().item() if oracle.numel() else 0.0
    scale = scale if scale == scale and scale > 0 else 1.0  # NaN or zero: absolute only
    torch.testing.assert_close(
        actual.detach().to(torch.float64).cpu(),
        oracle.detach().to(torch.float64).cpu(),
        rtol=tol["rtol"],
        atol=tol["atol"] * scale,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def assert_no_worse_than_eager(actual, eager, oracle, what=""):
    """Low precision: the root-mean-square error against the float64 oracle is at most 1.5x
    eager's own (plus 1e-3 of the oracle's RMS, for ties at rounding boundaries), and the
    worst element at most 4x eager's worst (a non-unit upstream gradient is applied to
    gradients already rounded once: two roundings where eager has one)."""
    oracle = oracle.detach().double().cpu()
    diff = (actual.detach().double().cpu() - oracle).nan_to_num(0.0)
    diff_eager = (eager.detach().double().cpu() - oracle).nan_to_num(0.0)
    assert torch.isnan(actual).sum() == torch.isnan(eager).sum(), what
    if not oracle.numel():
        return
    rms = oracle.nan_to_num(0.0).pow(2).mean().sqrt().item()
    err, err_eager = diff.pow(2).mean().sqrt().item(), diff_eager.pow(2).mean().sqrt().item()
    assert err <= 1.5 * err_eager + 1e-3 * rms, f"{what}: RMS error {err:.3g} vs eager's {err_eager:.3g}"
    worst, worst_eager = diff.abs().max().item(), diff_eager.abs().max().item()
    assert worst <= 4 * worst_eager + 1e-3 * rms, (
        f"{what}: max error {worst:.3g} vs eager's {worst_eager:.3g}"
    )
