"""What is left untouched, and why: every skip keeps eager's result and names the cause."""

from __future__ import annotations

import json

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads
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
    last = logits[:, -1].amax(-1).mean()  # a selection of the token rows beside all of them
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 0 * last


SKIPS = [
    (logits_topk, "`.topk()` at test_matching.py"),
    (three_d_loss_input, "`.transpose()` at test_matching.py:24"),
    (not_a_weight_transpose, "right operand is not a transposed 2-D weight"),
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


def test_a_metric_on_a_selection_of_the_rows_is_tiled_and_exact():
    h, w, y = _inputs()
    report = tile_pass.explain(last_token_metric, *leaves(h, w, y))
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    compiled = torch.compile(last_token_metric, backend=tile_pass.backend("aot_eager", tile_tokens=4))
    ref, ref_grads = value_and_grads(last_token_metric, [t.double() if t.is_floating_point() else t for t in
                                                         leaves(h, w, y)])  # fmt: skip
    out, grads = value_and_grads(compiled, leaves(h, w, y))
    assert_close_to_oracle(out, ref, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        if rg is not None:
            assert_close_to_oracle(g, rg, torch.float32, "grad")


def test_reason_names_the_op_and_line_that_stopped_the_region():
    report = tile_pass.explain(logits_topk, *_inputs())
    reason = report.skipped[0].reason
    assert "`.topk()` at test_matching.py:" in reason and "logits.topk(3, -1)" in reason
    assert "no row-wise rule" in reason


def test_report_text_and_json():
    h, w, y = _inputs()

    def two_heads(h, w, y):  # one rewritten, one skipped
        a = F.cross_entropy(F.linear(h, w).view(-1, V).float(), y.view(-1))
        b = logits_topk(h, w, y)
        return a + b

    report = tile_pass.explain(two_heads, h.requires_grad_(), w.requires_grad_(), y)  # with a backward
    assert len(report.rewrites) == 1 and len(report.skipped) == 1
    text = str(report)
    assert "REWRITTEN F.linear -> .reshape() -> .float() -> cross_entropy(ignore_index=-100)" in text
    assert "reduction=mean" in text
    assert "SKIPPED" in text and "`.topk()`" in text and "no row-wise rule" in text
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


# Every spelling of the LM head's transpose a user writes (each torch version records some of them
# differently: ``W.T``/``W.mT`` are ``getattr`` nodes up to torch 2.13 and ``aten.numpy_T``/``aten.mT``
# from 2.14), each rewritten and exact on the installed torch through one normalisation.
HEADS = {
    "h @ w.T": lambda h, w: h @ w.T,
    "h @ w.mT": lambda h, w: h @ w.mT,
    "h @ w.t()": lambda h, w: h @ w.t(),
    "torch.matmul(h, w.mT)": lambda h, w: torch.matmul(h, w.mT),
    "torch.matmul(h, w.T.contiguous())": lambda h, w: torch.matmul(h, w.T.contiguous()),
    "torch.matmul(h, w.T).contiguous()": lambda h, w: torch.matmul(h, w.T).contiguous(),
    "h @ w.mT.contiguous()": lambda h, w: h @ w.mT.contiguous(),
    "h @ w.contiguous().T": lambda h, w: h @ w.contiguous().T,
    "h @ w.t().contiguous()": lambda h, w: h @ w.t().contiguous(),
    "h @ w.T.T.T": lambda h, w: h @ w.T.T.T,
    "h.matmul(w.transpose(0, 1))": lambda h, w: h.matmul(w.transpose(0, 1)),
    "h @ w.transpose(-1, -2)": lambda h, w: h @ w.transpose(-1, -2),
    "h @ w.transpose(dim0=1, dim1=0)": lambda h, w: h @ w.transpose(dim0=1, dim1=0),
    "h @ torch.transpose(w, 0, 1)": lambda h, w: h @ torch.transpose(w, 0, 1),
    "h @ w.swapaxes(0, 1)": lambda h, w: h @ w.swapaxes(0, 1),
    "h @ w.permute(1, 0)": lambda h, w: h @ w.permute(1, 0),
    "h @ torch.permute(w, (1, 0))": lambda h, w: h @ torch.permute(w, (1, 0)),
    "h @ torch.t(w)": lambda h, w: h @ torch.t(w),
    "h @ w.permute(1, 0).contiguous()": lambda h, w: h @ w.permute(1, 0).contiguous(),
    "torch.mm(h2d, w.T)": lambda h, w: torch.mm(h.reshape(-1, h.shape[-1]), w.T),
    "h.mm(w.mT)": lambda h, w: h.reshape(-1, h.shape[-1]).mm(w.mT),
    "F.linear(h, w)": lambda h, w: F.linear(h, w),
    "F.linear(h, w.contiguous())": lambda h, w: F.linear(h, w.contiguous()),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", list(HEADS))
def test_every_transpose_spelling_is_rewritten_and_exact(head, device):
    def loss_fn(h, w, y):
        return F.cross_entropy(HEADS[head](h, w).reshape(-1, V), y.reshape(-1))

    h, w, y = (t.to(device) for t in _inputs())
    report = tile_pass.explain(loss_fn, h, w, y)
    assert not report.skipped, str(report)
    assert len(report.rewrites) == 1, str(report)
    form = "F.linear" if head.startswith("F.linear") else "hidden @ W.T"
    assert report.rewrites[0].form.startswith(form), str(report)
    assert report.rewrites[0].vocab_size == V and report.rewrites[0].hidden_size == models.H

    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager")
    ref, ref_grads = value_and_grads(loss_fn, leaves(h, w, y))
    out, grads = value_and_grads(torch.compile(loss_fn, backend=backend), leaves(h, w, y))
    assert len(backend.report().rewrites) == 1, str(backend.report())
    assert_close_to_oracle(out, ref, torch.float32, "loss")
    for name, g, rg in zip(("hidden", "weight"), grads[:2], ref_grads[:2], strict=True):
        assert_close_to_oracle(g, rg, torch.float32, f"{name} grad")


# With no swap on the way, the right operand is the weight as stored, not its transpose: left as written.
# An even number of swaps (on a square weight) is the transpose of the inner view: rewritten and exact.
SQUARE = {  # the head, and whether it is rewritten
    "h @ w.contiguous()": (lambda h, w: h @ w.contiguous(), False),
    "h @ w.transpose(0, 0)": (lambda h, w: h @ w.transpose(0, 0), False),
    "h @ w.permute(0, 1).contiguous()": (lambda h, w: h @ w.permute(0, 1).contiguous(), False),
    "h @ w.T.T": (lambda h, w: h @ w.T.T, True),
    "h @ w.mT.t()": (lambda h, w: h @ w.mT.t(), True),
    "h @ w.permute(1, 0).transpose(-1, -2)": (lambda h, w: h @ w.permute(1, 0).transpose(-1, -2), True),
}


@pytest.mark.parametrize("head", list(SQUARE))
def test_the_weight_is_what_the_last_swap_transposes(head):
    def loss_fn(h, w, y):  # a square w: h @ w has H classes
        return F.cross_entropy(SQUARE[head][0](h, w).reshape(-1, models.H), y.reshape(-1))

    h, _, _ = _inputs()
    w = torch.randn(models.H, models.H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, models.H, (2, 7), generator=torch.Generator().manual_seed(2))
    report = tile_pass.explain(loss_fn, h, w, y)
    rewritten = SQUARE[head][1]
    if rewritten:
        assert len(report.rewrites) == 1 and not report.skipped, str(report)
    else:
        assert not report.rewrites, str(report)
        assert len(report.skipped) == 1 and "not a transposed 2-D weight" in report.skipped[0].reason
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager")
    ref, ref_grads = value_and_grads(loss_fn, leaves(h, w, y))
    out, grads = value_and_grads(torch.compile(loss_fn, backend=backend), leaves(h, w, y))
    assert len(backend.report().rewrites) == int(rewritten), str(backend.report())
    assert_close_to_oracle(out, ref, torch.float32, "loss")
    for name, g, rg in zip(("hidden", "weight"), grads[:2], ref_grads[:2], strict=True):
        assert_close_to_oracle(g, rg, torch.float32, f"{name} grad")
