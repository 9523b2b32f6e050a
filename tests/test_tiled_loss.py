"""The tiled loss itself (eager API) against a float64 eager oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tile_pass import linear_cross_entropy


def reference(hidden, weight, target, bias=None, *, upcast=True, **options):
    logits = F.linear(hidden, weight, bias)
    if upcast:
        logits = logits.float() if logits.dtype != torch.float64 else logits
    return F.cross_entropy(logits.view(-1, weight.shape[0]), target.view(-1), **options)


def masked_target(n, vocab, pattern, ignore_index=-100, tile=8, seed=0):
    """Targets with an ignore pattern that stresses token weighting across tiles."""
    g = torch.Generator().manual_seed(seed)
    low = 0 if ignore_index < 0 or ignore_index >= vocab else 0
    target = torch.randint(low, vocab, (n,), generator=g)
    if ignore_index in range(vocab):  # keep the ignored class out of the valid labels
        target[target == ignore_index] = (ignore_index + 1) % vocab
    if pattern == "none_ignored":
        pass
    elif pattern == "fully_masked_tile":
        target[tile : 2 * tile] = ignore_index
    elif pattern == "uneven":  # tile k keeps about k/(tiles) of its tokens
        for start in range(0, n, tile):
            keep = max(1, (start // tile) % 4)
            target[start + keep : start + tile] = ignore_index
    elif pattern == "more_tiles_than_valid":
        target[:] = ignore_index
        target[3] = 1
        target[n - 2] = 2
    elif pattern == "all_ignored":
        target[:] = ignore_index
    else:
        raise ValueError(pattern)
    return target


PATTERNS = ["none_ignored", "fully_masked_tile", "uneven", "more_tiles_than_valid", "all_ignored"]


def make_inputs(n, h, v, device, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    return [t if t is None else t.to(device) for t in (hidden, weight, b)]


def check(
    device, dtype, n=37, h=16, v=29, tile=8, pattern="uneven", reduction="mean", bias=False,
    ignore_index=-100, label_smoothing=0.0, upstream=None, frozen=(), upcast=True, seed=0,
):  # fmt: skip
    hidden64, weight64, bias64 = make_inputs(n, h, v, device, bias, seed)
    target = masked_target(n, v, pattern, ignore_index, tile, seed).to(device)
    options = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)

    def grad_flags(t, name):
        return name not in frozen

    oracle_in = leaves(hidden64, weight64, bias64)
    test_in = leaves(hidden64, weight64, bias64, dtype=dtype)
    for ins in (oracle_in, test_in):
        for t, name in zip(ins, ("hidden", "weight", "bias"), strict=True):
            if t is not None and not grad_flags(t, name):
                t.requires_grad_(False)
    if upstream == "scalar":
        up = torch.tensor(3.7, dtype=torch.float64, device=device)
    elif upstream == "per_token":
        up = torch.randn(n, dtype=torch.float64, device=device)
    else:
        up = None

    ref, ref_grads = value_and_grads(
        lambda a, w, b: reference(a, w, target, b, upcast=upcast, **options), oracle_in, up
    )
    out, grads = value_and_grads(
        lambda a, w, b: linear_cross_entropy(a, w, target, b, tile_tokens=tile, upcast=upcast, **options),
        test_in,
        up,
    )
    expected_dtype = torch.float32 if upcast and dtype != torch.float64 else dtype
    assert out.dtype == expected_dtype
    assert out.shape == ref.shape
    assert_close_to_oracle(out, ref, dtype, "loss")
    for name, g, rg, t in zip(("hidden", "weight", "bias"), grads, ref_grads, test_in, strict=True):
        assert (g is None) == (rg is None), name
        if g is not None:
            assert g.dtype == t.dtype, name
            assert_close_to_oracle(g, rg, dtype, f"grad {name}")
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_masks_and_reductions(device, dtype, reduction, pattern):
    check(device, dtype, pattern=pattern, reduction=reduction)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_matches_eager(device):
    """mean: NaN loss and zero gradients (eager's behaviour); sum: zero loss."""
    out, grads = check(device, torch.float32, pattern="all_ignored", reduction="mean")
    assert torch.isnan(out)
    assert all(torch.count_nonzero(g) == 0 for g in grads if g is not None)
    out, _ = check(device, torch.float32, pattern="all_ignored", reduction="sum")
    assert out.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("upstream", ["scalar", "per_token"])
def test_incoming_gradients(device, reduction, upstream):
    if upstream == "per_token" and reduction != "none":
        pytest.skip("a scalar loss has a scalar upstream gradient")
    if upstream == "scalar" and reduction == "none":
        upstream = None
    check(device, torch.float64, reduction=reduction, upstream=upstream, bias=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", [("weight",), ("hidden",), ("hidden", "weight")])
def test_frozen_inputs_get_no_gradient(device, reduction, frozen):
    check(device, torch.float64, reduction=reduction, bias=True, frozen=frozen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ignore_index", [0, 5, -1, 1000])
def test_other_ignore_index(device, ignore_index):
    check(device, torch.float64, ignore_index=ignore_index, pattern="uneven")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing(device, reduction):
    check(device, torch.float64, label_smoothing=0.1, reduction=reduction, pattern="fully_masked_tile")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32(device, reduction):
    check(device, torch.float32, reduction=reduction, bias=True, n=300, v=500, h=32, tile=64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("upcast", [True, False])
def test_bfloat16_no_worse_than_eager(device, upcast):
    """bfloat16: within bf16 tolerance of the float64 oracle, and never much worse than eager's
    own bfloat16 computation of the same expression."""
    n, h, v = 200, 64, 300
    hidden64, weight64, _ = make_inputs(n, h, v, device)
    target = masked_target(n, v, "uneven", tile=32).to(device)
    oracle, oracle_grads = value_and_grads(
        lambda a, w: reference(a, w, target, upcast=upcast), leaves(hidden64, weight64)
    )
    eager, eager_grads = value_and_grads(
        lambda a, w: reference(a, w, target, upcast=upcast),
        leaves(hidden64, weight64, dtype=torch.bfloat16),
    )
    tiled, tiled_grads = value_and_grads(
        lambda a, w: linear_cross_entropy(a, w, target, tile_tokens=32, upcast=upcast),
        leaves(hidden64, weight64, dtype=torch.bfloat16),
    )
    assert tiled.dtype == eager.dtype
    for name, t, e, o in zip(
        ("loss", "hidden", "weight"),
        [tiled, *tiled_grads],
        [eager, *eager_grads],
        [oracle, *oracle_grads],
        strict=True,
    ):
        assert t.dtype == e.dtype, name
        assert_close_to_oracle(t, o, torch.bfloat16, name)
        err_tiled = (t.double() - o).abs().max().item()
        err_eager = (e.double() - o).abs().max().item()
        assert err_tiled <= 2 * err_eager + 1e-3 * o.abs().max().item(), (name, err_tiled, err_eager)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_are_flattened(device):
    hidden, weight, _ = make_inputs(24, 8, 11, device)
    target = masked_target(24, 11, "uneven", tile=4).to(device)
    a = linear_cross_entropy(hidden.view(2, 12, 8), weight, target.view(2, 12), tile_tokens=5)
    b = reference(hidden, weight, target)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_runs_forward_only(device):
    hidden, weight, _ = make_inputs(20, 8, 11, device)
    hidden.requires_grad_()
    target = masked_target(20, 11, "uneven", tile=4).to(device)
    with torch.no_grad():
        out = linear_cross_entropy(hidden, weight, target, tile_tokens=4)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(hidden, weight, target))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.integers(1, 70),
    h=st.integers(1, 9),
    v=st.integers(2, 23),
    tile=st.integers(1, 40),
    density=st.floats(0.0, 1.0),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.2]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_oracle(n, h, v, tile, density, reduction, label_smoothing, bias, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) >= density] = -100
    up = torch.randn(n, generator=g, dtype=torch.float64) if reduction == "none" else None
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    ref, ref_grads = value_and_grads(
        lambda a, w, c: reference(a, w, target, c, **options), leaves(hidden, weight, b), up
    )
    out, grads = value_and_grads(
        lambda a, w, c: linear_cross_entropy(a, w, target, c, tile_tokens=tile, **options),
        leaves(hidden, weight, b),
        up,
    )
    assert_close_to_oracle(out, ref, torch.float64, "loss")
    for g_, rg in zip(grads, ref_grads, strict=True):
        if rg is not None:
            assert_close_to_oracle(g_, rg, torch.float64, "grad")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_tiles_match_oracle(device, reduction):
    """compile_tiles=True: the elementwise middle of each tile compiled by Inductor."""
    hidden, weight, bias = make_inputs(37, 16, 29, device, bias=True)
    target = masked_target(37, 29, "uneven", tile=8).to(device)
    up = torch.randn(37, dtype=torch.float64, device=device) if reduction == "none" else None
    options = dict(reduction=reduction, label_smoothing=0.1)
    ref, ref_grads = value_and_grads(
        lambda a, w, b: reference(a, w, target, b, **options), leaves(hidden, weight, bias), up
    )
    out, grads = value_and_grads(
        lambda a, w, b: linear_cross_entropy(a, w, target, b, tile_tokens=16, compile_tiles=True, **options),
        leaves(hidden, weight, bias, dtype=torch.float32),
        up,
    )
    assert_close_to_oracle(out, ref, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close_to_oracle(g, rg, torch.float32, "grad")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ignored_tokens_are_skipped_on_cpu(monkeypatch, reduction):
    """On CPU the tiles run only the labelled tokens (no device sync to find them): 24 of 64
    labelled in tiles of 16 is 2 tile calls, not 4, and loss and gradients stay eager's."""
    from tile_pass.tiles import _tile_function

    rows_run = []
    original = _tile_function.tile_kernel

    def spy(key):
        kernel = original(key)

        def call(hidden, *args):
            rows_run.append(hidden.shape[0])
            return kernel(hidden, *args)

        return call

    monkeypatch.setattr(_tile_function, "tile_kernel", spy)
    hidden, weight, _ = make_inputs(64, 8, 40, "cpu")
    target = torch.randint(0, 40, (64,))
    target[torch.randperm(64)[:40]] = -100
    up = torch.randn(64, dtype=torch.float64) if reduction == "none" else None
    ref, ref_grads = value_and_grads(
        lambda a, w: reference(a, w, target, reduction=reduction), leaves(hidden, weight), up
    )
    out, grads = value_and_grads(
        lambda a, w: linear_cross_entropy(a, w, target, reduction=reduction, tile_tokens=16),
        leaves(hidden, weight),
        up,
    )
    assert rows_run[:2] == [16, 16] and sum(rows_run) == (2 if reduction == "mean" else 4) * 16
    assert_close_to_oracle(out, ref, torch.float64, "loss")
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close_to_oracle(got, want, torch.float64, "grad")
    assert torch.all(grads[0][target == -100] == 0)
