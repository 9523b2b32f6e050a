"""TRL's GRPO forms (``logits[:, :-1, :]``, temperature, log-softmax + gather or TRL's own
``selective_log_softmax``, masked completions, advantages) are rewritten and exact: loss and
gradients against float64 eager, for a random upstream gradient, under aot_eager and inductor."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_to_oracle, assert_no_worse_than_eager, leaves
from trl_forms import FORMS, batch, on_head

import tile_pass

pytest.importorskip("trl")

B, T, H, V = 3, 11, 16, 97  # 30 predicted tokens; tiles of 8: uneven, one of them fully masked


def _check(step, compiled, dtype, backend):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids, mask, advantages = batch(B, T, V)
    upstream = torch.tensor(1.7)
    h, w = leaves(hidden, weight, dtype=dtype)
    loss = compiled(h, w, ids, mask, advantages)
    assert backend.report().rewrites, backend.report()
    grads = torch.autograd.grad(loss, (h, w), upstream.to(loss.dtype))
    h64, w64 = leaves(hidden, weight, dtype=torch.float64)
    oracle = step(h64, w64, ids, mask, advantages)
    oracle_grads = torch.autograd.grad(oracle, (h64, w64), upstream.double())
    if dtype == torch.float32:
        assert_close_to_oracle(loss, oracle, dtype, "loss")
        for got, want, name in zip(grads, oracle_grads, ("hidden", "weight"), strict=True):
            assert_close_to_oracle(got, want, dtype, name)
        return
    he, we = leaves(hidden, weight, dtype=dtype)
    eager = step(he, we, ids, mask, advantages)
    eager_grads = torch.autograd.grad(eager, (he, we), upstream.to(eager.dtype))
    assert_no_worse_than_eager(loss, eager, oracle, "loss")
    for got, ref, want, name in zip(grads, eager_grads, oracle_grads, ("hidden", "weight"), strict=True):
        assert_no_worse_than_eager(got, ref, want, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_trl_grpo_forms_are_rewritten_and_exact(form, dtype):
    step = on_head(FORMS[form])
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    _check(step, torch.compile(step, backend=backend), dtype, backend)
    text = str(backend.report())
    assert "slice tokens" in text and "N=30" in text, text


@pytest.mark.parametrize("form", list(FORMS))
def test_trl_grpo_forms_under_inductor(form):
    step = on_head(FORMS[form])
    backend = tile_pass.backend("inductor", tile_tokens=8)
    _check(step, torch.compile(step, backend=backend), torch.float32, backend)


def test_a_reader_without_a_rule_is_named_with_its_line():
    """A graph with an LM head whose logits are read only by an op without a rule: the report
    names that op and its line (not "no candidate")."""

    def head(hidden, weight):
        logits = torch.nn.functional.linear(hidden, weight)
        return logits.log_softmax(-1).cummax(-1).values.sum()

    backend = tile_pass.backend("eager", tile_tokens=8)
    g = torch.Generator().manual_seed(0)
    torch.compile(head, backend=backend)(torch.randn(6, H, generator=g), torch.randn(V, H, generator=g))
    report = backend.report()
    assert not report.rewrites and len(report.skipped) == 1, report
    reason = report.skipped[0].reason
    assert "cummax" in reason and "test_trl_forms.py:" in reason, reason
    assert "no linear + cross_entropy candidate" not in str(report)
