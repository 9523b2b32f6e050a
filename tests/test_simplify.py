"""Exact rewrites of the derived tile middle (tile_pass._simplify): each one is applied where
its pattern is, nowhere else, and the compiled tile gives the same bits with it as without."""

from __future__ import annotations

import copy

import pytest
import torch
from tile_kernels import V, call, ce_key, make_inputs
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass import _simplify, _tile_kernel
from tile_pass._tile_passes import compiled_middle

aten = torch.ops.aten


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
    _tile_kernel.clear_caches()
    yield counts
    _tile_kernel.clear_caches()


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
    assert rewrites.columns and all(rewrites.columns)  # the compiled middle
    monkeypatch.setattr(_simplify, "RULES", {})
    monkeypatch.setattr(_simplify, "split_label_column", lambda gm, index: False)
    _tile_kernel.clear_caches()
    plain = tile_outputs(key)
    assert rewrites[-1] == 0 and not rewrites.columns[-1]
    for got, want in zip(simplified, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_label_smoothing_keeps_the_reduction(rewrites):
    """With label smoothing the log-softmax gradient's input is no longer the NLL gradient
    alone (every class gets a share), so its row sum stays a sum and its label column is
    stored with the rest."""
    tile_outputs(key_for(torch.float32, label_smoothing=0.1))
    assert rewrites and not any(rewrites)
    assert rewrites.columns and not any(rewrites.columns)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_column_is_returned_and_scattered_back(dtype):
    """The split middle stores the gradient off the label and returns ``(label, value)``;
    scattering the value back gives the unsplit middle's stored gradient, ignored rows
    included (their column 0 is rewritten with its own value)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=gen).to(dtype)
    target = torch.tensor([1, -100, 10, 0, 4])
    grad = torch.rand(5, generator=gen)
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
