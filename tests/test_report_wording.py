"""Each line of the report states what is true of the graph it describes: a hand-written
scalar loss names its own reduction and the op whose gradient an unfused step makes, and a
graph with no backward (``torch.no_grad()``: a reference model's log-probabilities, an RL
rollout's scoring pass) claims nothing of gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES

import tile_pass

N, H, V = 24, 16, 96


def _inputs(device, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(device).requires_grad_(requires_grad)
    w = torch.randn(V, H, generator=g).to(device).requires_grad_(requires_grad)
    y = torch.randint(0, V, (N,), generator=g).to(device)
    return h, w, y


def hand_written_mean(h, w, y):
    """A cross entropy written as people write it for eager: no ``nll_loss`` anywhere."""
    log_probs = (h @ w.t()).float().log_softmax(-1)
    return -log_probs.gather(-1, y[:, None]).squeeze(-1).mean()


def cross_entropy(h, w, y):
    return F.cross_entropy(h @ w.t(), y)


def token_log_probs(h, w, y):
    """Per-token log-probabilities, as a reference model's scoring pass returns them."""
    return (h @ w.t()).log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)


def _only_rewrite(report):
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    return report.rewrites[0]


@pytest.mark.parametrize("device", DEVICES)
def test_hand_written_scalar_loss_names_its_reduction_and_no_nll_loss(device):
    rewrite = _only_rewrite(tile_pass.explain(hand_written_mean, *_inputs(device)))
    text = str(rewrite)
    # a value after "=": the user's own reduction steps, not a bare "one scalar loss"
    assert "reduction=.mean() -> neg: one scalar loss" in text, text
    assert "nll_loss" not in text, text
    # its backward makes gather's [N, V] gradient where a cross entropy makes nll_loss's
    assert f"gather's gradient {V * N * 4 / 1024:.1f} KiB" in text, text
    assert rewrite.loss_grad_ops == "gather" and rewrite.backward


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_still_names_nll_loss_and_its_reduction(device):
    text = str(_only_rewrite(tile_pass.explain(cross_entropy, *_inputs(device))))
    assert "reduction=mean: one scalar loss (its gradient formed in forward)" in text, text
    assert "nll_loss's gradient" in text and "in backward (logits gradient" in text, text


@pytest.mark.parametrize("fn", [cross_entropy, token_log_probs, hand_written_mean])
@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_report_claims_no_backward(device, fn):
    h, w, y = _inputs(device)
    with torch.no_grad():
        rewrite = _only_rewrite(tile_pass.explain(fn, h, w, y))
    text = str(rewrite)
    for claim in ("in backward", "re-derived", "gradient formed", "weight gradient:", "nll_loss", "saved"):
        assert claim not in text, (claim, text)
    assert "no backward runs (no output needs a gradient)" in text, text
    assert not rewrite.backward and rewrite.backward_bytes_avoided == 0
    assert rewrite.weight_grad_sum == "none"
    assert rewrite.logits_bytes["logits_grad"] == 0 and rewrite.logits_bytes["loss_grad"] == 0
    # float32: the unfused forward holds the logits and their log-probabilities at once
    assert rewrite.peak_bytes_avoided["unfused"] == 2 * N * V * 4 - rewrite.tile_buffer_bytes
    if fn is token_log_probs:
        assert rewrite.reduction.startswith("per-token outputs (no gradient: no output needs one")


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_through_the_backend_report_and_the_loss_unchanged(device):
    """The backend's own report (a rollout compiled once, run under no_grad) says the same, and
    the rewritten scoring pass returns eager's values."""
    backend = tile_pass.backend("aot_eager")
    h, w, y = _inputs(device, requires_grad=False)
    compiled = torch.compile(token_log_probs, backend=backend)
    with torch.no_grad():
        got = compiled(h, w, y)
    torch.testing.assert_close(got, token_log_probs(h, w, y), rtol=2e-5, atol=2e-6)
    text = str(backend.report())
    assert "1 region(s) rewritten" in text and "no backward runs" in text, text
    assert "in backward" not in text and "re-derived" not in text, text


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_outputs_with_grad_still_say_backward(device):
    """The counter-case: with a gradient, per-token outputs are differentiated in backward."""
    rewrite = _only_rewrite(tile_pass.explain(token_log_probs, *_inputs(device)))
    assert rewrite.reduction == "per-token outputs (gradient re-derived in backward)"
    assert rewrite.backward and "in backward (logits gradient" in str(rewrite)
