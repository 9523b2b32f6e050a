"""Exact rewrites of the derived tile middle (tile_pass.tiles._simplify): each one is applied where
its pattern is, nowhere else, and the compiled tile gives the same bits with it as without."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tile_kernels import V, call, ce_key, make_inputs, program_of, replace
from torch.fx.experimental.proxy_tensor import make_fx

import tile_pass
from tile_pass.plan import _tiling
from tile_pass.tiles import _simplify
from tile_pass.tiles._tile_passes import compiled_middle

aten = torch.ops.aten
#: Whether compiled middles store the logits gradient over the logits, where the label column is
#: split off. Not below torch 2.13, whose Inductor miscompiles that store: there the gradient is
#: an output of its own and no middle reaches ``split_label_column`` (the rules above it apply).
STORES = _tiling.STORE_GRAD_OVER_LOGITS


def key_for(dtype, **options):
    """The tile of the textbook cross entropy (or, ``log_probs=True``, of per-token log-probs)."""
    return ce_key(dtype, **{"label_smoothing": 0.0, **options})


def tile_outputs(key):
    hidden, weight, bias, target, coef, weight_acc, _ = make_inputs(key)
    target[1::7] = 3  # the class of zero weight below
    class_weights = None
    if key.row_inputs:
        class_weights = torch.rand(V, generator=torch.Generator().manual_seed(1))
        class_weights[3] = 0.0
    (losses,), grad_hidden, _ = call(key, hidden, weight, bias, target, coef, weight_acc, None, class_weights)
    return losses, grad_hidden, weight_acc


@pytest.fixture
def rewrites(monkeypatch):
    """The rewrites each compiled middle got, in order (and fresh tile caches around the test);
    ``rewrites.columns``: whether each compiled middle had its label column split off."""
    counts = Rewrites()

    def counting(gm):
        counts.append(_simplify.simplify(gm))
        return counts[-1]

    def splitting(gm, logits_index):
        counts.columns.append(_simplify.split_label_column(gm, logits_index))
        return counts.columns[-1]

    monkeypatch.setattr(compiled_middle, "simplify", counting)
    monkeypatch.setattr(compiled_middle, "split_label_column", splitting)
    tile_pass.clear_caches()
    yield counts
    tile_pass.clear_caches()


class Rewrites(list):
    def __init__(self):
        super().__init__()
        self.columns = []


CASES = {
    "float32": dict(dtype=torch.float32),
    "bf16-upcast": dict(dtype=torch.bfloat16, upcast=True),
    "bf16": dict(dtype=torch.bfloat16),
    "class-weights": dict(dtype=torch.float32, class_weights=True),
    # the per-token log-probabilities of RL losses: the gradient of a gather, scattered into zeros
    "log-probs": dict(dtype=torch.float32, log_probs=True),
    "bf16-upcast-log-probs": dict(dtype=torch.bfloat16, upcast=True, log_probs=True),
    # TRL's sampling temperature: the stored gradient is divided by it after the log-softmax's
    "log-probs-temperature": dict(dtype=torch.float32, log_probs=True, temperature=0.7),
    "bf16-upcast-log-probs-temperature": dict(
        dtype=torch.bfloat16, upcast=True, log_probs=True, temperature=0.7
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_label_row_sum_is_gathered_and_the_tile_is_the_same_to_the_bit(case, rewrites, monkeypatch):
    """With the label row sum gathered and the label column of the stored gradient split off,
    every loss and gradient of the compiled tile is the one without them, to the bit (up to the
    sign of a zero)."""
    key = key_for(**CASES[case])
    simplified = tile_outputs(key)
    assert rewrites and all(count == 1 for count in rewrites)  # the whole tile's middle and its blocks
    assert all(rewrites.columns) and bool(rewrites.columns) == STORES  # the compiled middle
    monkeypatch.setattr(_simplify, "RULES", {})
    monkeypatch.setattr(_simplify, "split_label_column", lambda gm, index: False)
    tile_pass.clear_caches()
    plain = tile_outputs(key)
    assert rewrites[-1] == 0 and rewrites.columns[-1:] == [False] * STORES
    for got, want in zip(simplified, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_label_smoothing_keeps_the_reduction(rewrites):
    """With label smoothing the log-softmax gradient's input is no longer the NLL gradient
    alone (every class gets a share), so its row sum stays a sum and its label column is
    stored with the rest."""
    tile_outputs(key_for(torch.float32, label_smoothing=0.1))
    assert rewrites and not any(rewrites)
    assert not any(rewrites.columns) and bool(rewrites.columns) == STORES


def _middle(log_probs, target, grad):
    picked = aten.nll_loss_backward(grad, log_probs, target, None, 0, -100, torch.ones(()))
    return (aten._log_softmax_backward_data(picked, log_probs, 1, torch.float32),)


def test_the_rule_leaves_other_sums_alone():
    """Only a log-softmax gradient over an NLL gradient is rewritten, not its neighbours."""
    log_probs = torch.randn(4, 10).log_softmax(1)
    target = torch.tensor([1, -100, 9, 0])
    grad = torch.rand(4)
    gm = make_fx(_middle)(log_probs, target, grad)
    assert _simplify.simplify(gm) == 1
    assert not any(n.target is aten._log_softmax_backward_data.default for n in gm.graph.nodes)
    # eager's fused log-softmax backward rounds its own way; the bits are compared compiled, above
    torch.testing.assert_close(gm(log_probs, target, grad)[0], _middle(log_probs, target, grad)[0])

    def other(log_probs, grad_rows):
        return (aten._log_softmax_backward_data(grad_rows, log_probs, 1, torch.float32),)

    gm = make_fx(other)(log_probs, torch.randn(4, 10))
    assert _simplify.simplify(gm) == 0


def _stored_middle(logits, target, grad):
    log_probs = aten._log_softmax(logits.float(), 1, False)
    picked = aten.nll_loss_backward(grad, log_probs, target, None, 0, -100, torch.ones(()))
    gradient = aten._log_softmax_backward_data(picked, log_probs, 1, torch.float32)
    logits.copy_(gradient.to(logits.dtype))
    return (log_probs.sum(1),)


def _label_column_inputs(seed: int, dtype: torch.dtype):
    """Five rows of 11 logits, one ignored label and one at each end of the vocabulary, and the
    rows' incoming gradients."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 11, generator=gen).to(dtype)
    return logits, torch.tensor([1, -100, 10, 0, 4]), torch.rand(5, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_column_is_returned_and_scattered_back(dtype):
    """The split middle stores the gradient off the label and returns ``(label, value)``;
    scattering the value back gives the unsplit middle's stored gradient, ignored rows
    included (their column 0 is rewritten with its own value)."""
    logits, target, grad = _label_column_inputs(3, dtype)
    unsplit = make_fx(_stored_middle)(logits.clone(), target, grad)
    assert _simplify.simplify(unsplit) == 1
    gm = copy.deepcopy(unsplit)
    assert _simplify.split_label_column(gm, 0)
    assert not any(
        n.target is aten.copy_.default and n.args[1].target is aten.sub.Tensor for n in gm.graph.nodes
    )
    split = logits.clone()
    *outputs, label, value = gm(split, target, grad)
    assert label.shape == value.shape == (5, 1) and label[:, 0].tolist() == [1, 0, 10, 0, 4]
    split.scatter_(1, label, value)
    whole = logits.clone()
    expected = unsplit(whole, target, grad)  # the same ops unsplit (eager's fused kernel rounds its own way)
    assert torch.equal(split, whole) and torch.equal(outputs[0], expected[0])


def test_label_column_needs_the_stored_nll_gradient():
    """A stored gradient that is not ``nll_gradient - dense`` (here: the NLL gradient plus a
    term of its own) keeps its label column."""

    def middle(logits, target, grad):
        log_probs = aten._log_softmax(logits, 1, False)
        picked = aten.nll_loss_backward(grad, log_probs, target, None, 0, -100, torch.ones(()))
        logits.copy_(picked + log_probs.exp())
        return (log_probs.sum(1),)

    gm = make_fx(middle)(torch.randn(3, 7), torch.tensor([1, 2, 3]), torch.rand(3))
    assert not _simplify.split_label_column(gm, 0)


def z_loss(hidden, weight, bias, target, class_weights):  # PaLM's z-loss on the cross entropy
    logits = F.linear(hidden, weight)
    ce = F.cross_entropy(logits, target, reduction="none")
    return (ce + 1e-4 * logits.logsumexp(-1).pow(2),)


def entropy_bonus(hidden, weight, bias, target, class_weights):
    logits = F.linear(hidden, weight)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return (F.cross_entropy(logits, target, reduction="none") - 0.01 * entropy,)


#: the logsumexp or softmax of these losses has the row statistics of their log-softmax;
#: 1000 classes: a vectorized row with a tail
SHARED = {"z-loss": z_loss, "entropy": entropy_bonus}
SHARED_VOCAB = 1000


def shared_key(form):
    key = ce_key(torch.float32, label_smoothing=0.0, vocab=SHARED_VOCAB)
    return replace(key, program=program_of(SHARED[form], torch.float32, False, vocab=SHARED_VOCAB).key)


def without_shared_statistics():
    return {op: rule for op, rule in _simplify.RULES.items() if rule is not _simplify._shared_row_statistics}


@pytest.mark.parametrize("form", list(SHARED))
def test_shared_row_statistics_tile_is_the_same_to_the_bit(form, rewrites, monkeypatch):
    """With the row statistics shared (and the label row sum gathered after it), every loss and
    gradient of the compiled tile is the one without sharing. (The stored gradient has the
    logsumexp's or entropy's own term, so no label column is split off either way.)"""
    key = shared_key(form)
    shared = tile_outputs(key)
    assert rewrites == [2]  # shared, and the label row sum gathered
    monkeypatch.setattr(_simplify, "RULES", without_shared_statistics())
    tile_pass.clear_caches()
    plain = tile_outputs(key)
    assert rewrites[-1] == 1 and rewrites.columns == [False, False] * STORES
    for got, want in zip(shared, plain, strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def middles(monkeypatch):
    """The tile middles handed to ``simplify``, as they were before it (fresh tile caches)."""
    found = []

    def recording(gm):
        found.append(copy.deepcopy(gm))
        return _simplify.simplify(gm)

    monkeypatch.setattr(compiled_middle, "simplify", recording)
    tile_pass.clear_caches()
    yield found
    tile_pass.clear_caches()


def non_finite_logits(rows, vocab):
    """Random rows of several scales, and rows with +inf (with and without -inf), -inf
    everywhere, +inf everywhere, a NaN, some -inf under a finite maximum."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    logits[3, 11] = float("nan")
    logits[4, [0, 999]] = float("inf")
    logits[4, 5] = float("-inf")
    logits[5] = float("inf")
    logits[6, ::3] = float("-inf")
    logits[7, 9] = float("nan")
    logits[7, 10] = float("inf")
    logits[8] = 3e38  # the sum of exponentials is exact, the shift is 0
    return logits


def bits(value: torch.Tensor) -> torch.Tensor:
    """``value``'s bits (a zero's sign included)."""
    return value.view(torch.int32) if value.dtype == torch.float32 else value


def run_compiled(gm, logits, target, coef):
    """The compiled middle's outputs, and the logits gradient it stored over its logits input."""
    from torch._inductor.compile_fx import compile_fx

    gm = copy.deepcopy(gm)
    inputs = [logits.clone(), target, coef]
    with torch.no_grad():
        outputs = compile_fx(gm, [t.clone() for t in inputs])(*inputs)
    return [*outputs, inputs[0]]


@pytest.mark.parametrize("form", list(SHARED))
def test_shared_row_statistics_are_one_amax_and_one_sum_and_the_same_bits(form, middles, monkeypatch):
    """The rewritten middle reads one ``amax`` and one ``sum`` of exponentials of the logits,
    no ``logsumexp``/``softmax``/``log_softmax`` of its own; compiled, its losses and stored
    gradient have the bits of the middle without sharing, on rows with infinities and NaNs too
    (NaN where it has NaN)."""
    tile_outputs(shared_key(form))
    (middle,) = middles  # the tile is one block
    plain, shared = copy.deepcopy(middle), copy.deepcopy(middle)
    with monkeypatch.context() as patch:
        patch.setattr(_simplify, "RULES", without_shared_statistics())
        assert _simplify.simplify(plain) == 1
    assert _simplify.simplify(shared) == 2
    targets = [n.target for n in shared.graph.nodes]
    assert targets.count(aten.amax.default) == 1
    sums = [n for n in shared.graph.nodes if n.target is aten.sum.dim_IntList]
    assert [n.args[0].target for n in sums].count(aten.exp.default) == 1
    assert not set(targets) & set(_simplify._ROW_FUNCTIONS)

    logits, target, coef = (n.meta["val"] for n in middle.graph.nodes if n.op == "placeholder")
    logits = non_finite_logits(*logits.shape)
    target = torch.randint(0, SHARED_VOCAB, target.shape, generator=torch.Generator().manual_seed(6))
    target[::5] = -100
    coef = torch.rand(coef.shape, generator=torch.Generator().manual_seed(7))
    got, want = (run_compiled(gm, logits, target, coef) for gm in (shared, plain))
    assert any(v.isnan().any() for v in want)  # the non-finite rows reach the outputs
    for g, w in zip(got, want, strict=True):  # a NaN's payload is no value: it may differ
        nan = w.isnan()
        assert torch.equal(g.isnan(), nan) and torch.equal(bits(g)[~nan], bits(w)[~nan])


def test_shared_row_statistics_need_the_same_input_dim_and_a_float_row():
    """Nothing is shared from a lone logsumexp, across dims, across inputs, or on bfloat16;
    a log-softmax and a logsumexp of the same rows (dims spelt -1 and 1) share one sum."""
    x = torch.randn(4, 10)

    def count(fn, *inputs):
        return _simplify.simplify(make_fx(fn)(*inputs))

    assert count(lambda x: (x.logsumexp(-1),), x) == 0
    assert count(lambda x: (x.log_softmax(1), x.logsumexp(0)), x) == 0
    assert count(lambda x: (x.softmax(0), x.log_softmax(1)), x) == 0
    assert count(lambda x, y: (x.log_softmax(-1), y.logsumexp(-1)), x, x.clone()) == 0
    assert count(lambda x: (x.log_softmax(-1), x.logsumexp(-1)), x.bfloat16()) == 0

    def both(x):
        return x.log_softmax(-1), x.logsumexp(1), x.logsumexp(-1, keepdim=True), x.softmax(1)

    gm = make_fx(both)(x)
    assert _simplify.simplify(gm) == 1
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(aten.amax.default) == 1 and targets.count(aten.sum.dim_IntList) == 1
    for got, want in zip(gm(x), both(x), strict=True):  # eager's fused kernels round their own way
        torch.testing.assert_close(got, want)


def _stored_middle_with_lse(logits, target, grad):
    upcast = logits.float()
    log_probs = aten._log_softmax(upcast, 1, False)
    lse = aten.logsumexp(upcast, [-1])  # a z-loss logged, not differentiated
    picked = aten.nll_loss_backward(grad, log_probs, target, None, 0, -100, torch.ones(()))
    gradient = aten._log_softmax_backward_data(picked, log_probs, 1, torch.float32)
    logits.copy_(gradient.to(logits.dtype))
    return log_probs.sum(1), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_column_is_split_off_after_the_row_statistics_are_shared(dtype):
    """The log-softmax written out for a logsumexp still feeds the label row sum's rule and the
    label column's: its gradient at the label is computed from the logits gathered there."""
    logits, target, grad = _label_column_inputs(4, dtype)
    unsplit = make_fx(_stored_middle_with_lse)(logits.clone(), target, grad)
    assert _simplify.simplify(unsplit) == 2
    assert not any(n.target in _simplify._ROW_FUNCTIONS for n in unsplit.graph.nodes)
    gm = copy.deepcopy(unsplit)
    assert _simplify.split_label_column(gm, 0)
    split = logits.clone()
    *outputs, label, value = gm(split, target, grad)
    split.scatter_(1, label, value)
    whole = logits.clone()
    expected = unsplit(whole, target, grad)
    assert torch.equal(split, whole)
    assert all(torch.equal(got, want) for got, want in zip(outputs, expected, strict=True))
