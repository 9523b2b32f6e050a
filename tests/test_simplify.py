"""Exact rewrites of the derived tile middle (tile_pass._simplify): each one is applied where
its pattern is, nowhere else, and the compiled tile gives the same bits with it as without."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass import _simplify, _tile_kernel
from tile_pass._tile_kernel import KernelKey, LossHead, tile_kernel

aten = torch.ops.aten
T, H, V = 32, 16, 96


def key_for(dtype, ops=(), label_smoothing=0.0, class_weights=False):
    return KernelKey(
        head=LossHead(tuple(ops), -100, label_smoothing, class_weight=0 if class_weights else -1),
        tile=T,
        hidden_size=H,
        vocab_size=V,
        hidden_dtype=dtype,
        weight_dtype=dtype,
        bias_dtype=None,
        target_dtype=torch.int64,
        extras=(((V,), torch.float32),) if class_weights else (),
        device=torch.device("cpu"),
        need_hidden=True,
        need_weight=True,
        need_bias=False,
        acc_dtype=torch.float32,
        compiled=True,
    )


def tile_outputs(key):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen).to(key.hidden_dtype)
    weight = torch.randn(V, H, generator=gen).to(key.weight_dtype)
    target = torch.randint(0, V, (T,), generator=gen)
    target[::5] = -100
    target[1::7] = 3  # the class of zero weight below
    extras = []
    if key.head.class_weight >= 0:
        class_weights = torch.rand(V, generator=gen)
        class_weights[3] = 0.0
        extras = [class_weights]
    coef = torch.rand(T, generator=gen)
    weight_acc = torch.randn(V, H, generator=gen)
    losses, grad_hidden, _, _ = tile_kernel(key)(hidden, weight, None, target, extras, coef, weight_acc, None)
    return losses, grad_hidden, weight_acc


@pytest.fixture
def rewrites(monkeypatch):
    """The rewrites each compiled middle got, in order (and fresh tile caches around the test)."""
    counts = []

    def counting(gm):
        counts.append(_simplify.simplify(gm))
        return counts[-1]

    monkeypatch.setattr(_tile_kernel, "simplify", counting)
    _tile_kernel.clear_caches()
    yield counts
    _tile_kernel.clear_caches()


CASES = {
    "float32": dict(dtype=torch.float32),
    "bf16-upcast": dict(dtype=torch.bfloat16, ops=(("cast", "float32"),)),
    "bf16": dict(dtype=torch.bfloat16),
    "class-weights": dict(dtype=torch.float32, class_weights=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_label_row_sum_is_gathered_and_the_tile_is_the_same_to_the_bit(case, rewrites, monkeypatch):
    key = key_for(**CASES[case])
    simplified = tile_outputs(key)
    assert rewrites and all(count == 1 for count in rewrites)  # the whole tile's middle and its blocks
    monkeypatch.setattr(_simplify, "RULES", {})
    _tile_kernel.clear_caches()
    plain = tile_outputs(key)
    assert rewrites[-1] == 0
    for got, want in zip(simplified, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_label_smoothing_keeps_the_reduction(rewrites):
    """With label smoothing the log-softmax gradient's input is no longer the NLL gradient
    alone (every class gets a share), so its row sum stays a sum."""
    tile_outputs(key_for(torch.float32, label_smoothing=0.1))
    assert rewrites and not any(rewrites)


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
