"""In-place writes to the logits, as RL actors write them, take their op's rule and stay exact.

verl and NeMo-RL scale the logits with ``logits.div_(temperature)`` and read them by the same
name afterwards. The pass replays such writes out of place (``match/_functionalize.py``) so each
reader sees the version eager gives it; a write it cannot prove exact is left in place, the
region is skipped with the write's line, and the step still gives eager's result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle

import tile_pass

B, T, H, V = 2, 7, 8, 24
TILE = 3  # several tiles, the last short


def _logprobs(logits, labels):  # verl's logprobs_from_logits, its plain path
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _entropy(logits):  # verl's entropy_from_logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def _masked_mean(values, y):  # verl's masked_mean over the response tokens
    mask = (y != -100).to(values.dtype)
    return (values * mask).sum() / mask.sum()


def verl_padded(h, w, y):
    logits = h @ w.T
    logits.div_(0.7)
    logits = logits[:, -5:-1, :]
    response = y[:, -4:]
    return -_masked_mean(_logprobs(logits, response.clamp(min=0)), response) - 0.01 * _entropy(logits).mean()


def verl_remove_padding(h, w, y):
    logits = (h.reshape(1, -1, H) @ w.T).squeeze(0)
    logits.div_(0.7)
    return -_masked_mean(_logprobs(logits, y.reshape(-1).clamp(min=0)), y.reshape(-1))


def float_copy(h, w, y):
    logits = (h @ w.T).float()
    logits.div_(1.3)
    return -_masked_mean(_logprobs(logits, y.clamp(min=0)), y)


def chain(h, w, y):
    logits = h @ w.T
    logits.mul_(2.0).add_(0.5)
    logits.clamp_(-3.0, 3.0)
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def _one_write(write):
    def step(h, w, y):
        logits = h @ w.T
        write(logits, y)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)

    step.__name__ = write.__name__
    return step


def _div_(x, y):
    x.div_(0.9)


def _mul_(x, y):
    x.mul_(1.1)


def _add_(x, y):
    x.add_(0.25)


def _sub_(x, y):
    x.sub_(torch.linspace(0, 1, V, device=x.device, dtype=x.dtype))


def _clamp_(x, y):
    x.clamp_(min=-2.5)


def _masked_fill_(x, y):
    x.masked_fill_(torch.arange(V, device=x.device) >= V - 3, -1e4)  # a vocabulary mask, shared by every row


def _neg_(x, y):
    x.neg_()


def _itruediv(x, y):
    x /= 1.5


def _imul(x, y):
    x *= 0.5


def read_then_write(h, w, y):  # the old value is read before the write; max keeps no value for backward
    logits = h @ w.T
    best = logits.max(-1).values
    logits.div_(0.7)
    return F.cross_entropy(logits.view(-1, V), y.view(-1).clamp(min=0)) + best.mean()


WRITES = [_div_, _mul_, _add_, _sub_, _clamp_, _masked_fill_, _neg_, _itruediv, _imul]
TILED = [verl_padded, verl_remove_padding, float_copy, chain, read_then_write]
TILED += [_one_write(w) for w in WRITES]


def _data(device):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g).to(device)
    w = (torch.randn(V, H, generator=g) * 0.5).to(device)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :4] = -100  # a fully masked tile, uneven valid counts
    return h, w, y.to(device)


def _run(fn, h, w, y):
    h, w = (t.detach().clone().requires_grad_() for t in (h, w))
    loss = fn(h, w, y)
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", TILED, ids=[f.__name__ for f in TILED])
def test_inplace_write_is_tiled_and_exact(fn, device):
    h, w, y = _data(device)
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    got = _run(torch.compile(fn, backend=backend), h, w, y)
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    oracle = _run(fn, h.double(), w.double(), y)
    for actual, expected, what in zip(got, oracle, ("loss", "dh", "dw"), strict=True):
        assert actual.dtype == torch.float32
        assert_close_to_oracle(actual, expected, torch.float32, f"{fn.__name__} {what}")


def view_then_write(h, w, y):  # a name taken before the write, read after it: eager reads the new value
    logits = h @ w.T
    flat = logits.view(-1, V)
    logits.div_(0.7)
    return F.cross_entropy(flat, y.view(-1))


@pytest.mark.parametrize("fn", [view_then_write], ids=lambda f: f.__name__)
def test_write_not_proven_exact_is_left_in_place_and_named(fn):
    h, w, y = _data("cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    got = _run(torch.compile(fn, backend=backend), h, w, y)
    report = backend.report()
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    assert "logits.div_(0.7)" in report.skipped[0].reason, str(report)
    oracle = _run(fn, h.double(), w.double(), y)
    for actual, expected in zip(got, oracle, strict=True):
        assert_close_to_oracle(actual, expected, torch.float32, fn.__name__)


def test_write_to_a_graph_input_is_seen_by_the_caller():
    """Logits handed in from outside (after a graph break) are written as eager writes them."""

    def scale_and_loss(logits, y):
        logits.div_(2.0)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))

    h, w, y = _data("cpu")
    logits, expected_logits = h @ w.T, (h @ w.T)
    expected = scale_and_loss(expected_logits, y)
    got = torch.compile(scale_and_loss, backend=tile_pass.backend("aot_eager"))(logits, y)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(logits, expected_logits)  # divided once, in place, as in eager


def _exp_then_scale(h, w, y):  # exp_ keeps its result for its backward; mul_ writes over it
    logits = h @ w.T
    logits.exp_().mul_(0.5)
    return logits.sum()


def _logsumexp_then_scale(h, w, y):  # logsumexp keeps the logits it read; div_ writes over them
    logits = h @ w.T
    lse = logits.logsumexp(-1)
    logits.div_(0.7)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + lse.mean()


@pytest.mark.parametrize("fn", [_exp_then_scale, _logsumexp_then_scale], ids=lambda f: f.__name__)
def test_write_over_a_value_autograd_kept_raises_as_eager_does(fn):
    """Eager raises at backward when a write changes a value autograd kept. Replaying the write
    out of place would hide that error, so it stays in place and the step raises as eager's."""
    h, w, y = _data("cpu")
    y = y.clamp(min=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(fn, h, w, y)
    backend = tile_pass.backend("aot_eager")
    with pytest.raises(Exception, match="modified by an inplace operation"):
        _run(torch.compile(fn, backend=backend), h, w, y)


def test_bf16_float_copy_scaled_in_place():
    """A bf16 head's ``.float()`` copy scaled in place: the copy is its own memory."""
    h, w, y = _data("cpu")
    h, w = h.bfloat16(), w.bfloat16()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    got = _run(torch.compile(float_copy, backend=backend), h, w, y)
    assert len(backend.report().rewrites) == 1, str(backend.report())
    eager = _run(float_copy, h, w, y)
    assert got[0].dtype == eager[0].dtype == torch.float32
    assert [g.dtype for g in got[1:]] == [torch.bfloat16] * 2
    oracle = _run(float_copy, h.double(), w.double(), y)
    for actual, expected in zip(got, oracle, strict=True):
        assert_close_to_oracle(actual, expected, torch.bfloat16, "bf16 float copy")


def masked_writes(h, w, y):
    """torchtune's ``get_batch_log_probs`` and PPO: ``labels[labels == -100] = 0`` on a clone, then
    the log-probs, and padded positions set to 1.0 in place (``lp[pad] = 1.0``)."""
    logits = h @ w.T
    labels = y.clone()
    labels[labels == -100] = 0
    lp = _logprobs(logits, labels)
    pad = y == -100
    lp[pad] = 1.0
    return -(lp * ~pad).sum() / (~pad).sum()


def reference_after_policy(h, w, y):
    """A frozen reference head computed after the policy's logits are read, under no_grad: it moves
    before the policy's region, and both heads are tiled."""
    labels = y.clamp(min=0)
    policy = _logprobs(h @ w.T, labels)
    with torch.no_grad():
        reference = _logprobs(h.detach().flip(1) @ w.detach().T * 0.5, labels)
    return -F.logsigmoid((policy - reference).sum(-1)).mean()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [masked_writes, reference_after_policy], ids=lambda f: f.__name__)
def test_masked_writes_and_a_reference_head_after_the_policy(fn, device):
    h, w, y = _data(device)
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    got = _run(torch.compile(fn, backend=backend), h, w, y)
    report = backend.report()
    assert report.rewrites and not report.skipped, str(report)
    oracle = _run(fn, h.double(), w.double(), y)
    for actual, expected, what in zip(got, oracle, ("loss", "dh", "dw"), strict=True):
        assert_close_to_oracle(actual, expected, torch.float32, f"{fn.__name__} {what}")


def scale_under_no_grad(h, w, y):
    """A detached per-token scale computed after the logits are read, under no_grad, from the
    hidden states (which need a gradient): moving it before the region out of its no_grad block
    would send a gradient through it. It is not moved; the step stays exact."""
    policy = _logprobs(h @ w.T, y.clamp(min=0))
    with torch.no_grad():
        scale = (h * 2).sum(-1)
    return -(policy * scale).sum()


def test_a_value_computed_under_no_grad_is_not_moved_out_of_it():
    h, w, y = _data("cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    got = _run(torch.compile(scale_under_no_grad, backend=backend), h, w, y)
    oracle = _run(scale_under_no_grad, h.double(), w.double(), y)
    for actual, expected in zip(got, oracle, strict=True):
        assert_close_to_oracle(actual, expected, torch.float32, "scale under no_grad")
    report = backend.report()
    moved = [s.reason for s in report.skipped if "grad mode" in s.reason]
    assert report.rewrites or moved, str(report)
