"""Defects found by testing from outside, each pinned by a test that failed before its fix,
and property tests over input layouts that keep the class of bug from coming back.

The property tests compare shape, dtype, strides of the gradients' values, values and
gradients with eager (float64 oracle) for ``tile_pass.linear_cross_entropy`` and for the
backend, and check every custom op's fake implementation against its real one with
``torch.library.opcheck`` for each layout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tile_pass
from tile_pass import _textbook
from tile_pass.plan import _plan, _tiling
from tile_pass.plan._plan import RegionCall
from tile_pass.plan._tiling import TileSize
from tile_pass.program import _region
from tile_pass.tiles.tiled_region import _row_region, _row_region_backward, _row_region_loss

# ------------------------------------------------------------------ 1. double backward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_derivative_raises_where_it_is_requested(device, reduction):
    """It used to come back identically zero, with no error."""
    h = torch.randn(8, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(10, 16, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randint(0, 10, (8,), device=device)
    loss = tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="second derivative through the tiled loss"):
        torch.autograd.grad(loss, h, create_graph=True)
    # first derivatives are untouched by the check
    loss = tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4, reduction=reduction).sum()
    (grad,) = torch.autograd.grad(loss, h)
    (expected,) = torch.autograd.grad(F.cross_entropy(h @ w.T, y, reduction=reduction).sum(), h)
    torch.testing.assert_close(grad, expected)


def test_second_derivative_raises_under_the_backend():
    h = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(10, 16, requires_grad=True)
    y = torch.randint(0, 10, (8,))
    compiled = torch.compile(
        lambda h, w, y: F.cross_entropy(F.linear(h, w), y), backend=tile_pass.backend("eager", tile_tokens=4)
    )
    with pytest.raises(RuntimeError, match="second derivative through the tiled loss"):
        torch.autograd.grad(compiled(h, w, y), h, create_graph=True)


def test_second_derivative_through_returned_logits_is_exact():
    """The returned logits' gradient path is derived from copied forward code: exact to any order."""
    h = torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(models.V, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, models.V, (2, 4))

    def head(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.view(-1, models.V), y.view(-1)), logits

    def hessian_term(fn):
        _, logits = fn(h, w, y)
        (grad,) = torch.autograd.grad(logits.tanh().sum(), h, create_graph=True)
        return torch.autograd.grad(grad.pow(2).sum(), w)[0]

    compiled = torch.compile(head, backend=tile_pass.backend("eager", tile_tokens=4))
    torch.testing.assert_close(hessian_term(compiled), hessian_term(head))


# ------------------------------------------- 2. fakes agree with the real ops on strides


def test_transposed_weight_and_out_of_range_label_under_inductor():
    """One Inductor compile in a child process (an abort must not take the test run with it):
    a transposed LM-head weight used to fail the fake/real stride check, and an out-of-range
    label used to abort the process from inside a compiled tile (SIGABRT) where eager raises."""
    script = textwrap.dedent(
        """
        import json, torch, torch.nn.functional as F, tile_pass
        torch.manual_seed(0)
        def head(h, w, y):
            return F.cross_entropy(F.linear(h, w), y)
        h = torch.randn(40, 64, requires_grad=True)
        w_t = torch.randn(64, 1000, requires_grad=True)
        y = torch.randint(0, 1000, (40,))
        compiled = torch.compile(head, backend="tile_pass")
        loss = compiled(h, w_t.t(), y)
        loss.backward()
        ref_h, ref_w = h.detach().double().requires_grad_(), w_t.detach().double().requires_grad_()
        ref = head(ref_h, ref_w.t(), y)
        ref.backward()
        out = dict(
            rewritten=len(tile_pass.default_backend().report().rewrites),
            loss=abs(loss.item() - ref.item()),
            grad_h=(h.grad.double() - ref_h.grad).abs().max().item(),
            grad_w=(w_t.grad.double() - ref_w.grad).abs().max().item(),
            grad_w_strides=list(w_t.grad.stride()),
        )
        bad = y.clone()
        bad[7] = 1000
        try:
            compiled(h, w_t.t(), bad)
            out["bad_label"] = "no error"
        except IndexError as err:
            out["bad_label"] = f"IndexError: {err}"
        print(json.dumps(out))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rewritten"] == 1
    assert out["loss"] < 1e-5 and out["grad_h"] < 1e-5 and out["grad_w"] < 1e-5, out
    assert out["grad_w_strides"] == [1000, 1]  # autograd lays it out like the leaf
    assert out["bad_label"] == "IndexError: Target 1000 is out of bounds.", out


LAYOUTS = ["contiguous", "transposed_weight", "sliced_hidden", "expanded_labels", "transposed_hidden"]


def layout_inputs(layout, n, h, v, dtype, device, seed, pattern="uneven"):
    """hidden [n, h], weight [v, h], target [n], laid out as ``layout`` says."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    target = torch.randint(0, v, (n,), generator=g)
    if pattern == "uneven":
        target[torch.rand(n, generator=g) < 0.4] = -100
    elif pattern == "first_half_masked":
        target[: n // 2] = -100
    elif pattern == "all":
        target[:] = -100
    hidden, weight, target = hidden.to(device, dtype), weight.to(device, dtype), target.to(device)
    if layout == "transposed_weight":
        weight = weight.t().contiguous().t()
    elif layout == "transposed_hidden":
        hidden = hidden.t().contiguous().t()
    elif layout == "sliced_hidden":  # every other column of a wider buffer
        wide = torch.zeros(n, 2 * h, dtype=dtype, device=device)
        wide[:, ::2] = hidden
        hidden = wide[:, ::2]
    elif layout == "expanded_labels":  # one label broadcast over all tokens: stride 0
        target = target[:1].expand(n)
    return hidden, weight, target


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("need", [(True, True, False), (False, True, True), (True, False, True)])
def test_fake_implementations_agree_with_the_real_ops(layout, need):
    """opcheck runs each op for real and under fake tensors and compares shape, dtype and strides
    of every output (the stride mismatch that crashed Inductor was one of these)."""
    hidden, weight, target = layout_inputs(layout, 21, 8, 13, torch.float32, "cpu", seed=1)
    bias = torch.randn(13) if need[2] else None
    flags = dict(need=[need[0], need[1], need[2], False])  # hidden, weight, bias, the label
    for reduction, scale in (("mean", None), ("sum", 0.5), ("none", None)):
        options = _textbook.Options(
            13, 8, torch.float32, "cpu", bias is not None, False, False, False, scale, None, -100, 0.0,
            reduction, _textbook.constant_tiling(tile_pass.TileOptions(8, compile_tiles=False, strict=True)),
        )  # fmt: skip
        program = _program_of(options)
        common = dict(call=RegionCall(program, TileSize(8), False).key)
        fake = ("test_faketensor",)
        reduce = [target] * _region.lookup(program).counts.reduce  # a mean's: the labels it counts
        if reduction != "none":  # the scalar loss, its gradient formed in forward
            args = (hidden, weight, bias, [target, *reduce])
            loss_flags = dict(need=flags["need"] + [False] * len(reduce))
            torch.library.opcheck(
                _row_region_loss, args, {**common, **loss_flags}, test_utils=("test_faketensor",)
            )
            continue
        args = (hidden, weight, bias, [target])
        torch.library.opcheck(_row_region, args, common, test_utils=fake)
        args = ([torch.randn(21)], hidden, weight, bias, [target])
        torch.library.opcheck(
            _row_region_backward, args, {**common, **flags}, test_utils=("test_faketensor",)
        )


def _program_of(options) -> str:
    """The program key the rewritten textbook graph of ``options`` calls its region with."""
    from tile_pass.tiles.tiled_region import run_region

    graph = _textbook._build(options).graph
    return RegionCall.parse(next(n for n in graph.nodes if n.target is run_region).kwargs["call"]).program


def _eager(hidden, weight, target, bias, reduction, label_smoothing):
    logits = F.linear(hidden, weight, bias)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(logits, target, reduction=reduction, label_smoothing=label_smoothing)


def _check_against_eager(fn, layout, n, h, v, dtype, device, seed, pattern, reduction, smoothing, bias):
    hidden, weight, target = layout_inputs(layout, n, h, v, dtype, device, seed, pattern)
    b = torch.randn(v, dtype=dtype, device=device) if bias else None
    test = [t if t is None else t.detach().requires_grad_() for t in (hidden, weight, b)]
    oracle = [t if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, b)]
    out = fn(test[0], test[1], target, test[2], reduction, smoothing)
    ref = _eager(oracle[0], oracle[1], target, oracle[2], reduction, smoothing)
    eager_dtype = _eager(hidden, weight, target, b, reduction, smoothing).dtype
    assert out.shape == ref.shape and out.dtype == eager_dtype, (out.shape, ref.shape, out.dtype)
    assert_close_to_oracle(out, ref, dtype if dtype != torch.bfloat16 else torch.bfloat16, "loss")
    upstream = torch.randn(ref.shape, dtype=torch.float64, device=device)
    wanted = [t for t in test if t is not None]
    grads = torch.autograd.grad(out, wanted, upstream.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, [t for t in oracle if t is not None], upstream)
    for name, leaf, g, rg in zip(("hidden", "weight", "bias"), wanted, grads, ref_grads, strict=False):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype, name
        assert_close_to_oracle(g, rg, dtype, f"grad {name} ({layout})")


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS),
    n=st.integers(1, 40),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    tile=st.sampled_from([1, 3, 8, 16, None]),
    pattern=st.sampled_from(["none", "uneven", "first_half_masked", "all"]),
    smoothing=st.sampled_from([0.0, 0.1]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_linear_cross_entropy_matches_eager(
    device, layout, n, dtype, reduction, tile, pattern, smoothing, bias, seed
):
    h, v = 8, 13

    def tiled(hidden, weight, target, b, reduction, smoothing):
        return tile_pass.linear_cross_entropy(
            hidden, weight, target, b, reduction=reduction, label_smoothing=smoothing, tile_tokens=tile
        )

    _check_against_eager(tiled, layout, n, h, v, dtype, device, seed, pattern, reduction, smoothing, bias)


_COMPILED: dict = {}


@pytest.mark.shares_compiled
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS),
    n=st.sampled_from([6, 37]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    pattern=st.sampled_from(["none", "uneven", "first_half_masked"]),
    seed=st.integers(0, 2**16),
)
def test_property_backend_matches_eager(layout, n, reduction, pattern, seed):
    """The backend on ``F.cross_entropy(F.linear(h, w, b), y)`` over the same layouts; one
    compiled function per reduction, recompiled by Dynamo only where the layout changes."""
    backend = _COMPILED.setdefault("backend", tile_pass.backend("aot_eager", tile_tokens=8))
    compiled = _COMPILED.setdefault(
        reduction,
        torch.compile(
            lambda h, w, y, b: F.cross_entropy(F.linear(h, w, b), y, reduction=reduction), backend=backend
        ),
    )
    before = len(backend.report().rewrites)

    def run(hidden, weight, target, b, reduction, smoothing):
        return compiled(hidden, weight, target, b)

    _check_against_eager(run, layout, n, 8, 13, torch.float32, "cpu", seed, pattern, reduction, 0.0, True)
    assert len(backend.report().rewrites) >= before  # every graph compiled here was rewritten
    assert not backend.report().skipped


# ------------------------------------------------------------- 4. reduction="none" shape


@pytest.mark.parametrize("device", DEVICES)
def test_reduction_none_has_the_target_shape(device):
    h = torch.randn(3, 4, 8, device=device)
    w = torch.randn(10, 8, device=device)
    y = torch.randint(0, 10, (3, 4), device=device)
    assert tile_pass.linear_cross_entropy(h, w, y, reduction="none").shape == (3, 4)
    assert tile_pass.linear_cross_entropy(h[0, 0], w, y[0, 0], reduction="none").shape == ()
    assert tile_pass.linear_cross_entropy(h[0], w, y[0], reduction="none").shape == (4,)
    expected = F.cross_entropy(F.linear(h[0], w), y[0], reduction="none")  # F.linear_cross_entropy (2.13+)
    torch.testing.assert_close(tile_pass.linear_cross_entropy(h[0], w, y[0], reduction="none"), expected)
    assert tile_pass.linear_cross_entropy(h, w, y.view(-1), reduction="none").shape == (12,)


# ------------------------------------------------------------ 5. explain says what runs


def test_explain_reports_the_tile_the_backend_runs():
    """N=8192, V=32000 float32: the default backend (compiled tiles) runs 1024-token tiles (fewer
    where the CPU's last-level cache holds fewer); explain used to plan eager tiles and report 336 x 25."""
    n, h, v = 8192, 4, 32000
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h)
    target = torch.randint(0, v, (n,))

    def head(hidden, weight, target):
        return F.cross_entropy(F.linear(hidden, weight), target)

    report = tile_pass.explain(head, hidden, weight, target)
    (rewrite,) = report.rewrites
    assert rewrite.compiled_tiles and "compiled tiles" in str(report)
    planned = tile_pass.default_backend()
    assert "compile_tiles=True" in repr(planned)

    # the default backend's plan run with its inner compiler swapped for eager (the tiles
    # themselves are compiled by Inductor, as under backend="tile_pass")
    runner = tile_pass.backend("eager", compile_tiles=True)
    torch._dynamo.reset()
    with _plan.recorded() as plans:
        torch.compile(head, backend=runner)(hidden, weight, target)
    # 128 MiB of [tile, V] buffers: one per token before torch 2.13's in-place gradient, else two;
    # on a CPU whose last-level cache is smaller than that, the tiles that fit it (not below 256)
    budget = 1024 if _tiling.STORE_GRAD_OVER_LOGITS else 512
    row_bytes = _tiling.tile_bytes_per_token(v, torch.float32, False, fused=True)
    expected = _tiling.effective_tile(n, _tiling.TileSize(budget, automatic=True), row_bytes)
    assert expected == budget or expected < budget and _tiling.last_level_cache_bytes() < budget * row_bytes
    ran = plans[-1]  # what the tile loop ran
    assert (ran.rows, ran.tile) == (n, rewrite.tile_tokens) == (
        n,
        expected,
    ) and ran.num_tiles == rewrite.num_tiles
    assert rewrite.num_tiles == n // expected
    assert runner.report().rewrites[0].tile_tokens == rewrite.tile_tokens


# ------------------------------------------------------ 6. non-finite logit scale / cap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, 1e-30])
@pytest.mark.parametrize("kind", ["logit_scale", "softcap"])
def test_non_finite_constants_give_what_eager_gives(device, value, kind):
    h = torch.randn(6, 8, device=device)
    w = torch.randn(11, 8, device=device)
    y = torch.randint(0, 11, (6,), device=device)
    logits = F.linear(h, w)
    logits = logits * value if kind == "logit_scale" else value * torch.tanh(logits / value)
    expected = F.cross_entropy(logits, y)
    got = tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4, **{kind: value})
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_non_finite_constant_in_a_compiled_graph():
    h, w = torch.randn(6, 8), torch.randn(11, 8)
    y = torch.randint(0, 11, (6,))

    def head(h, w, y):
        return F.cross_entropy(F.linear(h, w) * math.inf, y)

    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    got = torch.compile(head, backend=backend)(h, w, y)
    assert backend.report().rewrites and "mul(inf)" in backend.report().rewrites[0].form
    torch.testing.assert_close(got, head(h, w, y), equal_nan=True)
