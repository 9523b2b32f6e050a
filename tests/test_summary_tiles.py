"""Coupled groups longer than a tile: per-summary weight-gradient sums, three GEMMs per token.

Where no tile holds a DPO pair, the op used to run the tiles twice (the outputs, then the
gradient at them: four GEMMs per token). When the loss reads the outputs only through summaries
linear in them, one per pair (``tile_pass.program._token_summaries``), each pair runs in tiles of
its own tokens with the summary's derivative as tangent, its weight-gradient share in a sum of
its own that the loss's derived gradient in the summary scales once the pair is done. Checked
against float64 eager at several tiles, with a fully masked sequence, uneven valid counts, a
fully masked tile (token skipping off), a frozen reference head and a bias.
"""

from __future__ import annotations

import losses_as_written as L
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle
from test_coupled_tiles import _data as _pairs

import tile_pass
from tile_pass.plan import _plan
from tile_pass.program._token_summaries import token_summaries
from tile_pass.program._token_weights import token_weights
from tile_pass.tiles import _coupled_tiles, _summary_tiles, tiled_region

B2, T, H, V = 6, 5, 8, 16  # three chosen/rejected pairs of 5 tokens


def dpo_reference_head(x, w, b, y, w_ref, beta=0.1):
    """DPO with the reference log-probabilities from a frozen head in the same step."""
    with torch.no_grad():
        reference = L._batch_logps((x @ w_ref.t()).float(), y)
    logits, half, _ = L._concatenated(x, w, b, y)
    logps = L._batch_logps(logits, y)
    margin = beta * ((logps[:half] - reference[:half]) - (logps[half:] - reference[half:]))
    return -F.logsigmoid(margin).mean()


#: forms whose groups (pairs) read the outputs only through one linear summary each
FORMS = {
    "dpo_with_rewards": lambda *a: L.dpo_with_rewards(*a)[0],
    "dpo_margin_in_place": L.dpo_margin_in_place,
    "ipo_loss_only": L.ipo_loss_only,
    "dpo_reference_head": dpo_reference_head,
}


def _data(device, dtype=torch.float64, empty=True):
    """test_coupled_tiles' three pairs (sequence 1 with no labelled token, sequence 4 with two), and
    a reference head's weight."""
    params, y, ref = _pairs(device, dtype, empty)
    w_ref = torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 0.5
    return params, y, ref, w_ref.to(device, dtype)


def _args(name, y, ref, w_ref):
    return (y, w_ref) if name == "dpo_reference_head" else (y, *ref)


def _step(fn, params, rest, upstream=1.5):
    leaves = [p.detach().requires_grad_() for p in params]
    loss = fn(*leaves, *rest)
    return loss.detach(), torch.autograd.grad(loss * upstream, leaves)


@pytest.fixture(autouse=True)
def _no_tile_holds_a_pair(monkeypatch):
    """Tiles never grow to hold a pair: every pair longer than the tile spans several."""
    monkeypatch.setattr(_coupled_tiles, "COUPLED_TILE_BYTES", 0)


def _compiled(name, tile, inner="aot_eager"):
    torch._dynamo.reset()
    backend = tile_pass.backend(inner, tile_tokens=tile, strict=True)
    return torch.compile(FORMS[name], backend=backend), backend


def _summary_loops(monkeypatch):
    """The group loops each step ran (a list per step of the rows of each group)."""
    loops = []
    original = _summary_tiles.summary_tiles

    def recorded(run_tiles, *args):
        groups = []

        def run(*a, rows=None, **k):
            groups.append(rows.numel() if a[4].any() else -rows.numel())  # negative: outputs only
            return run_tiles(*a, rows=rows, **k)

        loops.append(groups)
        return original(run, *args)

    monkeypatch.setattr(tiled_region, "summary_tiles", recorded)
    return loops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [2, 3, 4])
@pytest.mark.parametrize("name", list(FORMS))
@pytest.mark.parametrize("skipping", [True, False], ids=["skip", "noskip"])
def test_pairs_longer_than_a_tile_are_exact(name, tile, device, skipping, monkeypatch):
    """Pairs of 10 tokens in tiles of 2, 3 or 4 (groups over 2 to 5 tiles; the pair of one
    empty sequence and one of two tokens in one tile), exact against float64 eager. Without
    token skipping, the empty sequence is a fully masked tile at ``tile=4`` (and tiles of
    padding rows past the valid tokens)."""
    if not skipping:
        monkeypatch.setattr(tiled_region, "skipped_rows", lambda *a, **k: None)
    loops = _summary_loops(monkeypatch)
    params, y, ref, w_ref = _data(device, empty=name != "ipo_loss_only")
    fn, backend = _compiled(name, tile)
    rest = _args(name, y, ref, w_ref)
    loss, grads = _step(fn, params, rest)
    assert not backend.report().skipped, str(backend.report())
    assert len(loops) == 1 and len(loops[0]) == 3, loops  # one loop, a group per pair
    if skipping and device == "cpu":
        assert sorted(loops[0]) == ([2, 10, 10] if name != "ipo_loss_only" else [3, 10, 10])
    oracle_loss, oracle_grads = _step(
        FORMS[name], [p.double() for p in params], [r.double() if r.is_floating_point() else r for r in rest]
    )
    assert_close_to_oracle(loss, oracle_loss, torch.float32, f"{name} loss")
    for grad, oracle, what in zip(grads, oracle_grads, ("hidden", "weight", "bias"), strict=True):
        assert_close_to_oracle(grad, oracle, torch.float32, f"{name} d{what}")


def test_an_empty_averaged_sequence_is_nan_as_in_eager(monkeypatch):
    """IPO over a pair with an empty sequence is NaN in eager, its gradient NaN at every token
    of that pair (the skipped ones too): the loop finds the skipped tokens' weight non-finite
    and runs every token."""
    loops = _summary_loops(monkeypatch)
    params, y, ref, w_ref = _data("cpu")
    fn, _ = _compiled("ipo_loss_only", 3)
    loss, grads = _step(fn, params, (y, *ref))
    eager_loss, eager_grads = _step(L.ipo_loss_only, params, (y, *ref))
    assert loss.isnan() and eager_loss.isnan()
    assert [sorted(loop) for loop in loops] == [[2, 10, 10], [10, 10, 10]]
    for grad, eager in zip(grads, eager_grads, strict=True):
        assert torch.equal(grad.isnan(), eager.isnan())
        torch.testing.assert_close(grad, eager, equal_nan=True)


def test_the_scaled_unit_tangents_are_the_derived_gradient():
    """``g * u`` at every token is ``d loss / d output`` as autograd derives it on the whole
    reduction (``token_weights`` at the same outputs): the split is the chain rule, no more."""
    from tile_pass.program import _region

    params, y, ref, _ = _data("cpu")
    seen = {}
    original = tiled_region._summed_groups

    def spy(region, plan, given, shapes, *rest):
        seen.update(program=region, shapes=shapes, given=given)
        return original(region, plan, given, shapes, *rest)

    tiled_region._summed_groups = spy
    try:
        fn, _ = _compiled("dpo_with_rewards", 3)
        _step(fn, params, (y, *ref))
    finally:
        tiled_region._summed_groups = original
    program, shapes, given = seen["program"], seen["shapes"], seen["given"]
    summaries = token_summaries(program, shapes, given)
    assert summaries is not None
    g = torch.Generator().manual_seed(3)
    outputs = [torch.randn(s.shape, generator=g, dtype=s.dtype) for s in shapes]
    diff = [i for i, out in enumerate(program.outputs) if out.differentiable]
    unit = summaries.unit_tangents(shapes, given, diff)
    scale = summaries.group_gradients(outputs, given)[summaries.groups]
    with _region.dispatch_as_caller():
        derived = token_weights(program, outputs, given)
    assert set(derived) <= set(unit)
    for i in diff:
        expected = derived[i].expand(outputs[i].shape) if i in derived else torch.zeros_like(outputs[i])
        torch.testing.assert_close((unit[i] * scale).double(), expected.double(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "name", ["dpo_loss_only", "orpo_loss_only", "simpo_chunk_pairs", "chosen_gate", "batch_softmax_weighted"]
)
def test_losses_without_one_linear_summary_per_group_run_twice(name, monkeypatch):
    """DPO with an NLL term (a term linear in the outputs reaches the loss beside the margin),
    ORPO and SimPO (two summaries per pair), a gate read beside its margin, and a loss that
    couples every pair: no per-summary sums, the tiles run twice, and the result is exact."""
    loops = _summary_loops(monkeypatch)
    params, y, ref, _ = _data("cpu", empty=False)
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=3, strict=True)
    fn = torch.compile(getattr(L, name), backend=backend)
    with _plan.recorded() as plans:
        loss, grads = _step(fn, params, (y, *ref))
    assert not loops and [bool(p.coupled) for p in plans] == [False, False]
    oracle_loss, oracle_grads = _step(
        getattr(L, name), [p.double() for p in params], (y, *[r.double() for r in ref])
    )
    assert_close_to_oracle(loss, oracle_loss, torch.float32, f"{name} loss")
    for grad, oracle in zip(grads, oracle_grads, strict=True):
        assert_close_to_oracle(grad, oracle, torch.float32, f"{name} gradient")


#: the profiler's names of the tiles' GEMMs (oneDNN's linear on the CPU in float32)
_GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "mkldnn::_linear_pointwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_gemms_per_token(dtype):
    """Pairs of 10 and 2 labelled tokens in tiles of 2: every tile is full, and the profiler
    counts three GEMMs per tile (logits, hidden gradient, weight gradient), so three per token
    run; the two-pass fallback ran four."""
    params, y, ref, _ = _data("cpu", dtype)
    fn, _ = _compiled("dpo_with_rewards", 2)
    _step(fn, params, (y, *ref))  # compile and trace first
    with _plan.recorded() as plans, torch.profiler.profile() as prof:
        _step(fn, params, (y, *ref))
    count = sum(e.count for e in prof.key_averages() if e.key in _GEMMS)
    tokens = sum(p.rows for p in plans)
    assert sorted(p.rows for p in plans) == [2, 10, 10] and all(p.tile == 2 for p in plans)
    assert count == 3 * tokens // 2 and count == 3 * sum(p.num_tiles for p in plans)


def test_frozen_head_runs_no_weight_gradient():
    """Only the hidden states learn (a frozen policy head): the groups' hidden-state rows are
    scaled, no weight-gradient sum is made, and the result is exact."""
    params, y, ref, _ = _data("cpu")
    fn, _ = _compiled("dpo_with_rewards", 3)
    x, w, b = params
    leaf = x.detach().requires_grad_()
    loss = fn(leaf, w, b, y, *ref)
    (grad,) = torch.autograd.grad(loss, [leaf])
    x64 = x.detach().double().requires_grad_()
    oracle = L.dpo_with_rewards(x64, w.double(), b.double(), y, *[r.double() for r in ref])[0]
    (oracle_grad,) = torch.autograd.grad(oracle, [x64])
    assert_close_to_oracle(grad, oracle_grad, torch.float32, "dhidden")


def test_accumulation_pays_by_bytes():
    """One group needs no extra sum; many short groups of a wide head move more bytes through
    their sums than a second pass over their tiles would."""
    weight = torch.empty(1000, 4096)
    assert _summary_tiles.accumulation_pays([5000], 2048, weight, 12000)
    assert _summary_tiles.accumulation_pays([4096, 4096], 2048, weight, 12000)
    assert not _summary_tiles.accumulation_pays([300] * 8, 2048, weight, 12000)


def test_the_groups_loops_share_one_logits_buffer():
    """The loops run inside ``across_loops`` (one per group) take one logits buffer; a loop
    nested in a loop still has its own."""
    from tile_pass.tiles import _tile_buffers

    def take():
        return _tile_buffers._take((8, 10), torch.float32, torch.device("cpu")).data_ptr()

    with _tile_buffers.across_loops():
        with _tile_buffers.shared():
            first = take()
            with _tile_buffers.shared():
                nested = take()
        with _tile_buffers.shared():
            second = take()
    assert first == second and nested != first


def dpo_last_token_unread(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """DPO over each sequence but its last token, the per-token log-probabilities returned."""
    logits, half, _ = L._concatenated(x, w, b, y)
    mask = y != L.IGNORE
    per_token = torch.gather(logits.log_softmax(-1), 2, torch.where(mask, y, 0).unsqueeze(2)).squeeze(2)
    logps = (per_token * mask)[:, :-1].sum(-1)
    margin = beta * ((logps[:half] - ref_chosen) - (logps[half:] - ref_rejected))
    return -F.logsigmoid(margin).mean(), per_token.detach()


def test_tokens_no_summary_reads_run_for_their_outputs(monkeypatch):
    """The last token of each sequence reaches no summary: those tokens run once more, for their
    returned outputs only (no gradient), after the pairs' groups."""
    loops = _summary_loops(monkeypatch)
    params, y, ref, _ = _data("cpu", empty=False)
    torch._dynamo.reset()
    fn = torch.compile(
        dpo_last_token_unread, backend=tile_pass.backend("aot_eager", tile_tokens=2, strict=True)
    )

    def step(f):
        leaves = [p.detach().requires_grad_() for p in params]
        loss, per_token = f(*leaves, y, *ref)
        return loss.detach(), per_token, torch.autograd.grad(loss, leaves)

    loss, per_token, grads = step(fn)
    assert loops == [[8, 8, 8, -B2]]
    oracle = step(lambda *a: dpo_last_token_unread(*[t.double() if t.is_floating_point() else t for t in a]))
    assert_close_to_oracle(loss, oracle[0], torch.float32, "loss")
    assert_close_to_oracle(per_token, oracle[1], torch.float32, "per-token log-probabilities")
    for grad, want in zip(grads, oracle[2], strict=True):
        assert_close_to_oracle(grad, want, torch.float32, "gradient")


@pytest.mark.slow
def test_inductor_and_bf16(monkeypatch):
    """Under Inductor (the tiles' middle compiled): float32 in per-summary sums, exact;
    bfloat16 weights refused (their group sums would be rounded before their scale), two passes,
    no worse than eager."""
    from conftest import assert_no_worse_than_eager

    loops = _summary_loops(monkeypatch)
    fn, backend = _compiled("dpo_with_rewards", 3, "inductor")
    for dtype in (torch.float32, torch.bfloat16):
        params, y, ref, _ = _data("cpu", dtype)
        loss, grads = _step(fn, params, (y, *ref))
        oracle_loss, oracle_grads = _step(
            FORMS["dpo_with_rewards"], [p.double() for p in params], (y, *[r.double() for r in ref])
        )
        if dtype == torch.float32:
            assert len(loops) == 1
            assert_close_to_oracle(loss, oracle_loss, dtype, "loss")
            for grad, oracle in zip(grads, oracle_grads, strict=True):
                assert_close_to_oracle(grad, oracle, dtype, "gradient")
        else:
            assert len(loops) == 1  # no second loop of groups: two passes
            eager_loss, eager_grads = _step(FORMS["dpo_with_rewards"], params, (y, *ref))
            assert_no_worse_than_eager(loss, eager_loss, oracle_loss, "bf16 loss")
            for grad, eager, oracle in zip(grads, eager_grads, oracle_grads, strict=True):
                assert_no_worse_than_eager(grad, eager, oracle, "bf16 gradient")
    assert not backend.report().skipped
