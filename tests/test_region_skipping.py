"""Row-wise regions run only the tokens that can change a result (CPU).

A token is left out of the tiles where every output the caller needs is zero whatever its
logits (a cross entropy's ignored label, a product with a zero mask, ``where(mask, x, 0)``)
or reaches the scalar loss with a zero token weight (a mask applied in the reduction). The
plan the tiles ran (``tile_pass.plan._plan.recorded()``: rows, tile, schedule per loop) shows
it; the loss and gradients stay float64 eager's, with a fully masked tile and uneven counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_oracle, leaves

import tile_pass
from tile_pass.plan import _plan

N, H, V, TILE = 40, 16, 53, 8


def masked_grpo(h, w, y, mask):  # the mask multiplies the per-token log-probs inside the region
    logp = F.linear(h, w).log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def mask_in_the_reduction(h, w, y, mask):  # per-token log-probs, masked after the region
    logits = F.linear(h, w)
    logp = torch.gather(logits, -1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return -(logp.view(4, -1) * mask.view(4, -1)).sum(-1).mean()


def ce_plus_masked_entropy(h, w, y, mask):  # ignored labels and a masked entropy: both zero there
    logits = F.linear(h, w)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return F.cross_entropy(logits, y) - 0.1 * torch.where(mask.bool(), entropy, 0.0).sum() / mask.sum()


def z_loss_over_every_token(h, w, y, mask):  # the z-loss reads every token: nothing is left out
    logits = F.linear(h, w)
    return F.cross_entropy(logits, y) + 1e-2 * logits.logsumexp(-1).pow(2).mean()


def per_token_log_probs(h, w, y, mask):  # returned per token; zero where the label is ignored
    return -F.cross_entropy(F.linear(h, w), y, reduction="none")


TEACHER = torch.randn(N, V, generator=torch.Generator().manual_seed(1)).log_softmax(-1)


def masked_distillation(h, w, y, mask):  # a teacher's [N, V] rows: gathered, a short tile padded
    kl = (TEACHER.exp() * (TEACHER - F.linear(h, w).log_softmax(-1))).sum(-1)
    return (kl * mask).sum() / mask.sum()


SKIPPING = {masked_grpo: "mask", mask_in_the_reduction: "mask", ce_plus_masked_entropy: "mask",
            per_token_log_probs: "labels", masked_distillation: "mask",
            z_loss_over_every_token: None}  # fmt: skip


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.4).float()
    mask[:TILE] = 0  # a fully masked tile
    y[mask == 0] = -100
    return h, w, y, mask


@pytest.mark.parametrize("fn", list(SKIPPING), ids=[f.__name__ for f in SKIPPING])
def test_tiles_run_only_the_tokens_that_count(fn):
    h, w, y, mask = _inputs()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    compiled = torch.compile(fn, backend=backend)
    hc, wc = leaves(h, w)
    with _plan.recorded() as plans:
        out = compiled(hc, wc, y, mask)
    ran = plans[-1].rows
    assert backend.report().rewrites, backend.report()
    tangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (hc, wc), tangent)
    h64, w64 = leaves(h, w, dtype=torch.float64)
    ref = fn(h64, w64, y, mask.double())
    ref_grads = torch.autograd.grad(ref, (h64, w64), tangent.double())
    assert_close_to_oracle(out, ref, torch.float32, "output")
    for got, want, name in zip(grads, ref_grads, ("hidden", "weight"), strict=True):
        assert_close_to_oracle(got, want, torch.float32, name)
    if SKIPPING[fn] is None:
        assert ran == N
    else:
        assert ran == int(mask.sum()), (ran, int(mask.sum()))


def test_a_non_finite_hidden_state_at_a_masked_token_keeps_eagers_nan():
    """A product with a zero mask is zero only where the logits are finite: eager's loss is NaN."""
    h, w, y, mask = _inputs()
    h[3] = float("nan")  # a masked token
    compiled = torch.compile(masked_grpo, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    with _plan.recorded() as plans:
        out = compiled(*leaves(h, w), y, mask)
    assert torch.isnan(masked_grpo(h, w, y, mask)) and torch.isnan(out)
    assert plans[-1].rows == N


def test_an_ignored_label_skips_even_a_non_finite_token():
    """The cross entropy of an ignored label is zero whatever the logits, as in eager."""
    h, w, y, mask = _inputs()
    h[3] = float("nan")

    def ce_and_z_loss_of_labelled(h, w, y):
        logits = F.linear(h, w)
        ce = F.cross_entropy(logits, y, reduction="none")
        z = torch.where(y != -100, logits.logsumexp(-1), 0.0).pow(2)
        return (ce + 1e-2 * z).sum() / (y != -100).sum()

    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    with _plan.recorded() as plans:
        out = torch.compile(ce_and_z_loss_of_labelled, backend=backend)(h, w, y)
    assert backend.report().rewrites
    eager = ce_and_z_loss_of_labelled(h, w, y)
    assert torch.isfinite(eager)
    torch.testing.assert_close(out, eager)
    assert plans[-1].rows == int((y != -100).sum())


def test_zero_expressions_combine_their_parts_flags_and_exactness():
    """A product is zero where any factor is, a sum where every term is; exact only where every part is."""
    from tile_pass.program._region import ZeroAll, ZeroAny, ZeroIf, ZeroKind, _canonical

    labels, mask = torch.tensor([-100, 3, -100, 5]), torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    ignored = ZeroIf(0, ZeroKind.EQUALS, -100)
    masked = ZeroIf(1, ZeroKind.ZERO, exact=False)
    kept = ZeroIf(1, ZeroKind.TRUE)
    tokens = [labels, mask]
    assert [f.tolist() for f in (ignored.tokens(tokens)[0], kept.tokens(tokens)[0])] == [
        [True, False, True, False], [True, False, False, True]]  # fmt: skip
    flags, exact = ZeroAny((ignored, masked)).tokens(tokens)
    assert flags.tolist() == [True, True, True, False] and not exact
    flags, exact = ZeroAll((ignored, masked)).tokens(tokens)
    assert flags.tolist() == [False, False, True, False] and not exact
    flags, exact = ZeroAll((ignored, ZeroAny((ignored, kept)))).tokens(tokens)
    assert flags.tolist() == [True, False, True, False] and exact
    assert ZeroAny((ignored, masked)) == ZeroAny((ignored, masked)) != ZeroAll((ignored, masked))
    assert len({ZeroAny((ignored, kept)), ZeroAny((ignored, kept))}) == 1
    assert _canonical(ZeroAll((ignored, kept))) == (
        "ZeroAll((ZeroIf(0,ZeroKind.EQUALS,-100,True),ZeroIf(1,ZeroKind.TRUE,None,True)))"
    )
    for parts in [(), (ignored,), (ignored, ("is", masked))]:
        with pytest.raises(ValueError):
            ZeroAny(parts)


def test_zero_rules_are_for_ops_the_matcher_replays():
    """A zero rule is a fact of an op that has a row-wise rule, registered once."""
    from tile_pass.program import _op_facts, _region
    from tile_pass.program._region import Ref, RefKind, Step, ZeroAny, ZeroIf, ZeroKind

    zeroed = {key for key, facts in _op_facts.FACTS.items() if facts.zeros is not None}
    assert all(_op_facts.FACTS[key].kind is not None for key in zeroed), zeroed
    facts = {name: getattr(_op_facts.FACTS["mul"], name) for name in _op_facts.FACT_NAMES}
    with pytest.raises(ValueError, match="already"):
        _op_facts.register_ops("mul", "a_new_op", kind=None, **{**facts, "shown": _op_facts.AS_KEY})(None)
    assert "a_new_op" not in _op_facts.FACTS
    ignored = ZeroIf(0, ZeroKind.EQUALS, -100)
    value, mask = Ref(RefKind.VALUE, 1), Ref(RefKind.TOKEN, 1)
    product = Step("call_function", torch.mul, (value, mask))
    masked = _region.zero_where(product, {1: ignored}, frozenset({0, 1}))
    assert masked == ZeroAny((ignored, ZeroIf(1, ZeroKind.ZERO, exact=False)))
    where = Step("call_function", torch.where, (mask, value, 0))
    assert _region.zero_where(where, {}, frozenset({1})) == ZeroIf(1, ZeroKind.FALSE)  # one part: itself
    assert _region.zero_where(Step("call_function", torch.exp, (value,)), {1: ignored}, frozenset()) is None
