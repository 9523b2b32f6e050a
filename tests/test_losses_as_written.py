"""Losses as people write them for eager PyTorch (``tests/losses_as_written.py``), tiled and exact.

Each case compiles the user's function unchanged with ``tile_pass.backend("aot_eager")`` and
several tiles (a fully masked tile, uneven valid counts, a short last tile), checks that the
report rewrote it with nothing skipped, and compares the loss and every gradient (hidden
states, weights, biases) with float64 eager.
"""

from __future__ import annotations

import losses_as_written as L
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle

import tile_pass

B2, T, H, HT, V = 4, 5, 8, 12, 16  # chosen and rejected pairs, 20 tokens
TILE = 3  # 7 tiles, the last short; the first fully masked


def _data(device, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B2, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g) if bias else None
    y = torch.randint(0, V, (B2, T), generator=g)
    y[0, :4] = L.IGNORE  # with TILE=3: a fully masked first tile
    y[2, 1:] = L.IGNORE  # uneven valid counts per tile
    ht = torch.randn(B2, T, HT, generator=g)
    wt = torch.randn(V, HT, generator=g) * 0.5
    extra = (torch.randn(B2 // 2, generator=g), torch.randn(B2 // 2, generator=g))
    rl = (torch.randn(B2, T, generator=g) - 3.0, torch.randn(B2, generator=g))
    tensors = dict(x=x, w=w, b=b, ht=ht, wt=wt)
    tensors = {k: None if v is None else v.to(device, dtype) for k, v in tensors.items()}
    return tensors, y.to(device), [t.to(device, dtype) for t in extra], [t.to(device, dtype) for t in rl]


def _call(fn, kind, tensors, y, extra, rl, trainable):
    leaves = {
        k: v if v is None or k not in trainable else v.detach().requires_grad_() for k, v in tensors.items()
    }
    if kind == "preference":
        args = (leaves["x"], leaves["w"], leaves["b"], y, *extra)
    elif kind == "rl":
        args = (leaves["x"], leaves["w"], leaves["b"], y, *rl)
    else:
        args = (leaves["x"], leaves["w"], leaves["ht"], leaves["wt"], y)
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum(o * (k + 1.5) for k, o in enumerate(outs))
    wanted = [leaves[k] for k in trainable if leaves[k] is not None]
    return [o.detach() for o in outs], torch.autograd.grad(total, wanted)


CASES = [
    ("dpo", "preference", ("x", "w", "b")),
    ("orpo", "preference", ("x", "w", "b")),
    ("simpo", "preference", ("x", "w")),
    ("dpo_shifted", "preference", ("x", "w", "b")),
    ("kto", "preference", ("x", "w", "b")),
    ("grpo", "rl", ("x", "w", "b")),
    ("distill_jsd", "distill", ("x", "w")),
    ("distill_forward_kl", "distill", ("x", "w")),
    ("distill_reverse_kl", "distill", ("x", "w")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "kind", "trainable"), CASES, ids=[c[0] for c in CASES])
def test_loss_as_written_is_tiled_and_exact(name, kind, trainable, device):
    fn = getattr(L, name)
    tensors, y, extra, rl = _data(device)
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, strict=True)
    outs, grads = _call(torch.compile(fn, backend=backend), kind, tensors, y, extra, rl, trainable)
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    double = {k: None if v is None else v.double() for k, v in tensors.items()}
    ref_outs, ref_grads = _call(fn, kind, double, y, [e.double() for e in extra], [r.double() for r in rl],
                                trainable)  # fmt: skip
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.dtype == torch.float32
        assert_close_to_oracle(out, ref, torch.float32, f"{name} output")
    for grad, ref, what in zip(grads, ref_grads, trainable, strict=True):
        assert_close_to_oracle(grad, ref, torch.float32, f"{name} d{what}")


# ------------------------------------------------------------ a graph break between head and loss


def _count_with_item(h, w, y):
    logits = h @ w.t()
    n = (y != L.IGNORE).sum().item()
    return F.cross_entropy(logits, y, reduction="sum") / n


def _branch_on_value(h, w, y):
    logits = h @ w.t()
    if torch.all(y == L.IGNORE):
        return logits.sum() * 0
    return F.cross_entropy(logits, y)


def _boolean_mask(h, w, y):
    logits = h @ w.t()
    keep = y != L.IGNORE
    return F.cross_entropy(logits[keep], y[keep])


@pytest.mark.parametrize(
    ("fn", "line", "fix"),
    [
        (_count_with_item, "n = (y != L.IGNORE).sum().item()", "capture_scalar_outputs = True"),
        (_branch_on_value, "if torch.all(y == L.IGNORE):", "torch.where"),
        (_boolean_mask, "return F.cross_entropy(logits[keep], y[keep])", "capture_dynamic_output_shape_ops"),
    ],
    ids=["item", "if_on_tensor", "boolean_mask"],
)
def test_graph_break_between_head_and_loss_is_named_with_its_fix(fn, line, fix):
    torch._dynamo.reset()
    h, w = torch.randn(6, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (6,))
    report = tile_pass.explain(fn, h, w, y)
    reasons = [s.reason for s in report.skipped if "graph break" in s.reason]
    assert reasons, str(report)
    assert "Dynamo broke the graph before it at test_losses_as_written.py:" in reasons[0], reasons[0]
    assert line in reasons[0] and fix in reasons[0], reasons[0]
