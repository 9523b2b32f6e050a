"""Scalar losses nonlinear in the tokens' outputs: tiles of whole coupled groups, exact.

DPO's ``logsigmoid`` of a margin of per-sequence sums couples each chosen sequence's tokens
with its rejected partner's. The op finds those groups from the loss's own graph
(``tile_pass.program._token_groups``), runs each group inside one tile, and each tile evaluates
``d loss / d output`` at its own outputs: the gradient is formed in forward, three GEMMs per
token. A loss that couples every token runs the tiles twice instead. Each case is checked
against float64 eager with a fully masked sequence, uneven valid counts and several tiles.
"""

from __future__ import annotations

import losses_as_written as L
import pytest
import torch
from conftest import DEVICES, assert_close_to_oracle, assert_no_worse_than_eager

import tile_pass
from tile_pass.plan import _plan
from tile_pass.program._token_groups import token_groups
from tile_pass.tiles import _coupled_tiles

B2, T, H, V = 6, 5, 8, 16  # three chosen/rejected pairs of 5 tokens
TILE = 5  # smaller than a pair: tiles grow to whole pairs (at most 2 x TILE, see _bounded)

#: (form, coupled): whether its tiles hold whole coupled groups (False: two passes)
FORMS = [
    ("dpo_loss_only", True),
    ("ipo_loss_only", True),
    ("orpo_loss_only", True),
    ("simpo_chunk_pairs", True),
    ("batch_softmax_weighted", False),
    ("worst_pair", False),
    ("chosen_gate", True),
    ("dpo_margin_in_place", True),  # the write is replayed out of place before matching
]
#: forms that average over a sequence's labelled tokens: an empty sequence makes them NaN
AVERAGED = {"ipo_loss_only", "orpo_loss_only", "simpo_chunk_pairs"}


def _data(device, dtype=torch.float32, empty=True):
    """Three pairs; sequence 1 has no labelled token (``empty``; else one), sequence 4 two."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B2, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g)
    y = torch.randint(0, V, (B2, T), generator=g)
    y[1, 1 - empty :] = L.IGNORE  # a fully masked (chosen) sequence, its pair's tokens all skipped
    y[4, 2:] = L.IGNORE  # uneven valid counts
    ref = (torch.randn(B2 // 2, generator=g) - 3.0, torch.randn(B2 // 2, generator=g) - 3.0)
    return [t.to(device, dtype) for t in (x, w, b)], y.to(device), [r.to(device, dtype) for r in ref]


def _step(fn, params, y, ref, upstream=1.5):
    leaves = [p.detach().requires_grad_() for p in params]
    loss = fn(leaves[0], leaves[1], leaves[2], y, *ref)
    return loss.detach(), torch.autograd.grad(loss * upstream, leaves)


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    """Groups of up to 2 x TILE tokens (a pair) grow a tile, the whole batch does not: at this
    vocabulary the byte bound alone would let one tile hold all 30 tokens."""
    monkeypatch.setattr(_coupled_tiles, "COUPLED_TILE_BYTES", 0)


def _compiled(name, inner="aot_eager"):
    torch._dynamo.reset()
    backend = tile_pass.backend(inner, tile_tokens=TILE, strict=True)
    return torch.compile(getattr(L, name), backend=backend), backend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "coupled"), FORMS, ids=[f[0] for f in FORMS])
def test_nonlinear_loss_is_one_op_and_exact(name, coupled, device):
    params, y, ref = _data(device, empty=name not in AVERAGED)
    fn, backend = _compiled(name)
    with _plan.recorded() as plans:
        loss, grads = _step(fn, params, y, ref)
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    assert "nonlinear in the tokens' outputs" in report.rewrites[0].reduction
    # coupled: one loop of tiles sized to whole pairs; otherwise outputs, then the gradient
    assert [bool(p.coupled) for p in plans] == ([True] if coupled else [False, False])
    oracle_loss, oracle_grads = _step(
        getattr(L, name), [p.double() for p in params], y, [r.double() for r in ref]
    )
    assert loss.dtype == torch.float32
    assert_close_to_oracle(loss, oracle_loss, torch.float32, f"{name} loss")
    for grad, oracle, what in zip(grads, oracle_grads, ("hidden", "weight", "bias"), strict=True):
        assert_close_to_oracle(grad, oracle, torch.float32, f"{name} d{what}")


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_averaged_sequence_is_nan_as_in_eager(device):
    """IPO over a sequence with no labelled token averages 0/0: eager's loss is NaN, and so is
    its gradient at every token of that pair, the skipped ones included (zero times NaN). The
    tiles skip those tokens first, find the loss's weight there non-finite, and run them."""
    params, y, ref = _data(device, torch.float64)
    fn, _ = _compiled("ipo_loss_only")
    with _plan.recorded() as plans:
        loss, grads = _step(fn, params, y, ref)
    eager_loss, eager_grads = _step(L.ipo_loss_only, params, y, ref)
    assert loss.isnan() and eager_loss.isnan()
    assert [bool(p.coupled) for p in plans] == [True, True]
    for grad, eager in zip(grads, eager_grads, strict=True):
        assert torch.equal(grad.isnan(), eager.isnan())
        torch.testing.assert_close(grad, eager, equal_nan=True)


_SEQUENCE = torch.arange(B2 * T) // T
#: which tokens each loss couples: DPO-like losses a sequence with its partner, KTO a sequence
#: alone, a softmax or a min over the batch everything
COUPLED = {
    "dpo_loss_only": _SEQUENCE % (B2 // 2),
    "ipo_loss_only": _SEQUENCE % (B2 // 2),
    "chosen_gate": _SEQUENCE % (B2 // 2),
    "kto": _SEQUENCE,
    "batch_softmax_weighted": torch.zeros(B2 * T, dtype=torch.int64),
    "worst_pair": torch.zeros(B2 * T, dtype=torch.int64),
}


@pytest.mark.parametrize("name", COUPLED)
def test_the_groups_found(name, monkeypatch):
    """The groups are exactly the tokens each loss couples, no more and no fewer."""
    found = []

    def recorded(program, outputs, inputs):
        found.append(token_groups(program, outputs, inputs))
        return found[-1]

    monkeypatch.setattr(_coupled_tiles, "token_groups", recorded)
    params, y, ref = _data("cpu", torch.float64)
    fn, _ = _compiled(name)
    _step(fn, params, y, ref)
    groups = found[0]  # (IPO's empty sequence asks twice: see the NaN test)
    expected = COUPLED[name]
    assert torch.equal(groups[:, None] == groups[None, :], expected[:, None] == expected[None, :])


def test_the_groups_carry_the_gradient(monkeypatch):
    """Tiles that split a pair (every token its own group) give a wrong gradient: the groups are
    what makes the in-tile gradient exact, not the tolerance."""
    params, y, ref = _data("cpu", torch.float64)
    monkeypatch.setattr(_coupled_tiles, "token_groups", lambda program, outputs, inputs: torch.arange(B2 * T))
    fn, _ = _compiled("dpo_loss_only")
    loss, grads = _step(fn, params, y, ref)
    oracle_loss, oracle_grads = _step(L.dpo_loss_only, params, y, ref)
    torch.testing.assert_close(loss, oracle_loss)  # the loss is formed from all outputs after the tiles
    assert (grads[0] - oracle_grads[0]).abs().max() > 1e-3


#: the profiler's names of the tiles' GEMMs (oneDNN's linear on the CPU in float32)
_GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "mkldnn::_linear_pointwise")


def test_gemms_per_token():
    """Coupled tiles run three GEMMs each (logits, hidden gradient, weight gradient); two passes
    run four per tile (the logits twice)."""

    def gemms(name):
        params, y, ref = _data("cpu")
        fn, _ = _compiled(name)
        _step(fn, params, y, ref)  # compile and trace first
        with _plan.recorded() as plans, torch.profiler.profile() as prof:
            _step(fn, params, y, ref)
        count = sum(e.count for e in prof.key_averages() if e.key in _GEMMS)
        return count, plans

    count, plans = gemms("dpo_loss_only")
    assert plans[0].coupled == 2 and count == 3 * 2  # pairs of 10 and 2 labelled tokens, then 10
    count, plans = gemms("batch_softmax_weighted")
    assert not any(p.coupled for p in plans) and count == plans[0].num_tiles + 3 * plans[1].num_tiles


def test_inductor_and_bf16():
    """A representative case under Inductor (the tile's middle compiled with the in-tile
    gradient inside it), in float32 and bfloat16."""
    fn, backend = _compiled("dpo_loss_only", "inductor")
    for dtype in (torch.float32, torch.bfloat16):
        params, y, ref = _data("cpu", dtype)
        with _plan.recorded() as plans:
            loss, grads = _step(fn, params, y, ref)
        assert [bool(p.coupled) for p in plans] == [True]
        oracle_loss, oracle_grads = _step(
            L.dpo_loss_only, [p.double() for p in params], y, [r.double() for r in ref]
        )
        if dtype == torch.float32:
            assert_close_to_oracle(loss, oracle_loss, dtype, "loss")
            for grad, oracle in zip(grads, oracle_grads, strict=True):
                assert_close_to_oracle(grad, oracle, dtype, "gradient")
        else:
            eager_loss, eager_grads = _step(L.dpo_loss_only, params, y, ref)
            assert loss.dtype == eager_loss.dtype
            assert_no_worse_than_eager(loss, eager_loss, oracle_loss, "bf16 loss")
            for grad, eager, oracle in zip(grads, eager_grads, oracle_grads, strict=True):
                assert grad.dtype == torch.bfloat16
                assert_no_worse_than_eager(grad, eager, oracle, "bf16 gradient")
    assert not backend.report().skipped


def test_no_grad_runs_one_pass():
    params, y, ref = _data("cpu", torch.float64)
    fn, _ = _compiled("dpo_loss_only")
    with torch.no_grad(), _plan.recorded() as plans:
        loss = fn(*params, y, *ref)
    torch.testing.assert_close(loss, L.dpo_loss_only(*params, y, *ref))
    assert [bool(p.coupled) for p in plans] == [False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("metrics_backward", [False, True])
def test_metrics_beside_the_loss(device, metrics_backward):
    """DPO that also returns a metric of each half's logits (``logits[:B].mean()``): the loss's
    gradient is formed in coupled tiles in forward; a metric's own gradient, where one arrives,
    is a re-run of the tiles in backward. Where none arrives (``loss.backward()``), the re-run
    has no token to run (on the CPU: every tangent is zero)."""
    params, y, ref = _data(device, torch.float64)
    fn, _ = _compiled("dpo")

    def step(f):
        leaves = [p.detach().requires_grad_() for p in params]
        loss, chosen, rejected = f(leaves[0], leaves[1], leaves[2], y, *ref)
        total = loss + (0.5 * chosen - 2.0 * rejected if metrics_backward else 0.0)
        return loss.detach(), torch.autograd.grad(total, leaves)

    with _plan.recorded() as plans:
        loss, grads = step(fn)
    oracle_loss, oracle_grads = step(L.dpo)
    torch.testing.assert_close(loss, oracle_loss)
    for grad, oracle in zip(grads, oracle_grads, strict=True):
        torch.testing.assert_close(grad, oracle)
    assert plans[0].coupled
    if device == "cpu":
        assert plans[1].rows == (B2 * T if metrics_backward else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_detached_rewards_beside_the_loss(device):
    """DPO returning each pair's detached rewards, as preference trainers log them: the loss
    takes coupled tiles (one loop, its gradient formed in forward) and the graph computes the
    rewards from the op's per-token outputs, exactly eager's."""
    params, y, ref = _data(device, torch.float64)
    fn, backend = _compiled("dpo_with_rewards")

    def step(f):
        leaves = [p.detach().requires_grad_() for p in params]
        loss, chosen, rejected = f(leaves[0], leaves[1], leaves[2], y, *ref)
        return (loss, chosen, rejected), torch.autograd.grad(loss, leaves)

    with _plan.recorded() as plans:
        values, grads = step(fn)
    oracle_values, oracle_grads = step(L.dpo_with_rewards)
    assert [bool(p.coupled) for p in plans] == [True]
    assert "nonlinear in the tokens' outputs" in backend.report().rewrites[0].reduction
    for got, oracle in zip((*values, *grads), (*oracle_values, *oracle_grads), strict=True):
        torch.testing.assert_close(got, oracle)
    assert not values[1].requires_grad and not values[2].requires_grad


def test_new_sequence_lengths_trace_no_new_tile():
    """A dynamic sequence length (the batch of pairs static: a row selection with symbolic bounds
    is refused, see the limits): batches of other lengths reuse the compiled graph and the traced
    tile functions (a coupled tile's key holds no batch size), exact at each length."""
    from tile_pass.tiles import _tile_kernel

    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    fn = torch.compile(L.dpo_loss_only, backend=backend)
    traced = []
    for length in (5, 4, 3):  # pairs of 10, 8 and 6 tokens: tiles of 16 rows each time
        g = torch.Generator().manual_seed(length)
        x = torch.randn(B2, length, H, generator=g, dtype=torch.float64)
        w, b = (
            torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5,
            torch.randn(V, generator=g, dtype=torch.float64),
        )
        y = torch.randint(0, V, (B2, length), generator=g)
        y[0, 1:] = L.IGNORE
        ref = [torch.randn(B2 // 2, generator=g, dtype=torch.float64) for _ in range(2)]
        torch._dynamo.maybe_mark_dynamic(x, 1)
        torch._dynamo.maybe_mark_dynamic(y, 1)
        with _plan.recorded() as plans:
            loss, grads = _step(fn, [x, w, b], y, ref)
        oracle_loss, oracle_grads = _step(L.dpo_loss_only, [x, w, b], y, ref)
        torch.testing.assert_close(loss, oracle_loss)
        for grad, oracle in zip(grads, oracle_grads, strict=True):
            torch.testing.assert_close(grad, oracle)
        assert [bool(p.coupled) for p in plans] == [True]
        traced.append(len(_tile_kernel._cache))
    report = backend.report()  # the first length's graph, then one with a symbolic length
    assert len(report.rewrites) == len(report.graphs) <= 2 and not report.skipped, str(report)
    assert traced[0] == traced[1] == traced[2], traced  # no tile function traced per batch size
