"""What is left untouched, and why: every skip keeps eager's result and names the cause."""

from __future__ import annotations

import json

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_oracle, leaves, value_and_grads
from models import V

import tile_pass


def logits_topk(h, w, y):
    logits = F.linear(h, w).view(-1, V)
    top3 = (logits.topk(3, -1).indices == y.view(-1, 1)).any(-1).float().mean()  # no row-wise rule
    return F.cross_entropy(logits, y.view(-1)) + 0 * top3


def three_d_loss_input(h, w, y):
    return F.cross_entropy(F.linear(h, w).transpose(1, 2), y)


def not_a_weight_transpose(h, w, y):
    return F.cross_entropy((h @ w.t()[:, :V]).view(-1, V), y.view(-1))


def last_token_metric(h, w, y):
    logits = F.linear(h, w)
    last = logits[:, -1].amax(-1).mean()  # a slice of the token rows, kept whole
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 0 * last


SKIPS = [
    (logits_topk, "`.topk()` at test_matching.py"),
    (three_d_loss_input, "`.transpose()` at test_matching.py:24"),
    (not_a_weight_transpose, "right operand is not a transposed 2-D weight"),
    (last_token_metric, "slices the logits' token rows"),
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, models.H, generator=g)
    w = torch.randn(V, models.H, generator=g)
    y = torch.randint(0, V, (2, 7), generator=g)
    y[0, :3] = -100
    return h, w, y


@pytest.mark.parametrize(("fn", "reason"), SKIPS, ids=[f.__name__ for f, _ in SKIPS])
def test_skipped_with_reason_and_still_exact(fn, reason):
    h, w, y = _inputs()
    report = tile_pass.explain(fn, *leaves(h, w, y))
    assert not report.rewrites, str(report)
    assert len(report.skipped) == 1, str(report)
    assert reason in report.skipped[0].reason, str(report)
    assert "test_matching.py" in report.skipped[0].loss_source

    backend = tile_pass.backend("aot_eager")
    compiled = torch.compile(fn, backend=backend)
    ref, ref_grads = value_and_grads(fn, leaves(h, w, y))
    out, grads = value_and_grads(compiled, leaves(h, w, y))
    dtype = torch.float32
    assert_close_to_oracle(out, ref, dtype, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        if rg is not None:
            assert_close_to_oracle(g, rg, dtype, "grad")


def test_reason_names_the_op_and_line_that_stopped_the_region():
    report = tile_pass.explain(logits_topk, *_inputs())
    reason = report.skipped[0].reason
    assert "`.topk()` at test_matching.py:" in reason and "logits.topk(3, -1)" in reason
    assert "no row-wise rule" in reason


def test_report_text_and_json():
    h, w, y = _inputs()

    def two_heads(h, w, y):  # one rewritten, one skipped
        a = F.cross_entropy(F.linear(h, w).view(-1, V).float(), y.view(-1))
        b = last_token_metric(h, w, y)
        return a + b

    report = tile_pass.explain(two_heads, h, w, y)
    assert len(report.rewrites) == 1 and len(report.skipped) == 1
    text = str(report)
    assert "REWRITTEN F.linear -> .reshape() -> .float() -> cross_entropy(ignore_index=-100)" in text
    assert "reduction=mean" in text
    assert "SKIPPED" in text and "slices the logits' token rows" in text
    assert "N=14 H=16 V=29 float32" in text
    data = json.loads(report.to_json())
    assert data["rewrites"][0]["forward_bytes_avoided"] == 14 * V * 8
    assert data["rewrites"][0]["backward_bytes_avoided"] == 14 * V * 4


def test_explain_recompiles_after_another_backend():
    h, w, y = _inputs()
    torch.compile(models.f_linear_view_float, backend="aot_eager")(h, w, y)
    report = tile_pass.explain(models.f_linear_view_float, h, w, y)
    assert len(report.rewrites) == 1


def test_nothing_to_match():
    report = tile_pass.explain(lambda x: (x * 2).sum(), torch.randn(3))
    assert not report.rewrites and not report.skipped
    assert "no linear + cross_entropy candidate" in str(report)


def test_logging_through_torch_logs(capfd):
    import logging

    torch._logging.set_logs(modules={"tile_pass": logging.INFO})
    try:
        tile_pass.explain(models.f_linear_view_float, *_inputs())
    finally:
        torch._logging.set_logs()
    err = capfd.readouterr().err
    assert "REWRITTEN" in err
