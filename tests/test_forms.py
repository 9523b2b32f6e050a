"""Forms real models trace to: row-wise ops between head and loss, label shifts, returned logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads
from models import H, V
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import tile_pass

B, T = 3, 11


def softcap(h, w, y):  # Gemma 2 / 3
    logits = F.linear(h, w)
    logits = logits / 5.0
    logits = torch.tanh(logits)
    logits = logits * 5.0
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def logit_scale(h, w, y):  # Cohere
    return F.cross_entropy((F.linear(h, w) * 0.0625).view(-1, V), y.view(-1))


def bias_added_after(h, w, y):  # BART's final_logits_bias buffer
    final_logits_bias = torch.linspace(-1.0, 1.0, V, dtype=h.dtype, device=h.device).view(1, V)
    return F.cross_entropy((F.linear(h, w) + final_logits_bias).view(-1, V), y.view(-1))


def hidden_prescaled(h, w, y):  # T5 scales the hidden state before the head
    return F.cross_entropy(F.linear(h * H**-0.5, w).view(-1, V), y.view(-1))


def slice_shift(h, w, y):  # user code that shifts by slicing the logits
    logits = F.linear(h, w)
    shifted = logits[..., :-1, :].contiguous()
    return F.cross_entropy(shifted.view(-1, V), y[..., 1:].contiguous().view(-1))


def hf_pad_shift(h, w, y):  # transformers' ForCausalLMLoss: labels padded, logits untouched
    labels = F.pad(y, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(F.linear(h, w).float().view(-1, V), labels.contiguous().view(-1))


def num_items_tensor(h, w, y):
    n = (y != -100).sum()
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="sum") / n


def num_items_int(h, w, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="sum") / 17


def aux_loss_added(h, w, y):  # Mixtral router loss: untouched, added afterwards
    loss = F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1))
    return loss + 0.01 * h.pow(2).mean()


def log_softmax_nll(h, w, y):
    log_probs = F.log_softmax(F.linear(h, w).view(-1, V), dim=-1)
    return F.nll_loss(log_probs, y.view(-1))


def log_softmax_float32_nll(h, w, y):
    log_probs = torch.log_softmax(F.linear(h, w).view(-1, V), dim=1, dtype=torch.float32)
    return F.nll_loss(log_probs, y.view(-1), reduction="sum")


def module_built_in_forward(h, w, y):
    return nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)(F.linear(h, w).view(-1, V), y.view(-1))


def softcap_then_slice_with_bias(h, w, y, b=None):
    logits = F.linear(h, w, torch.ones(V, dtype=h.dtype, device=h.device) * 0.1)
    logits = torch.tanh(logits / 3.0) * 3.0
    return F.cross_entropy(logits[:, 1:, :].float().reshape(-1, V), y[:, :-1].reshape(-1))


FORMS = [
    softcap, logit_scale, bias_added_after, hidden_prescaled, slice_shift, hf_pad_shift,
    num_items_tensor, num_items_int, aux_loss_added, log_softmax_nll, log_softmax_float32_nll,
    module_built_in_forward, softcap_then_slice_with_bias,
]  # fmt: skip


def inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :8] = -100
    y[2, 6:] = -100
    return h.to(device), w.to(device), y.to(device)


def compare(fn, args, backend, dtype=torch.float32, upstream=None):
    compiled = torch.compile(fn, backend=backend)
    oracle, oracle_grads = value_and_grads(fn, leaves(*args), upstream)
    out, grads = value_and_grads(compiled, leaves(*args, dtype=dtype), upstream)
    assert_close_to_oracle(out, oracle, dtype, "output")
    for i, (g, rg) in enumerate(zip(grads, oracle_grads, strict=True)):
        if rg is not None:
            assert_close_to_oracle(g, rg, dtype, f"grad of input {i}")
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_form_is_rewritten_and_exact(form, device):
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compare(form, inputs(device), backend)
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)


def fp32_inputs():
    h, w, y = inputs("cpu")
    return h.float(), w.float(), y


def test_form_descriptions():
    report = tile_pass.explain(softcap, *fp32_inputs())
    form = report.rewrites[0].form
    assert "F.linear -> div(5.0) -> tanh -> mul(5.0) -> .float() -> .reshape() -> cross_entropy(" in form
    assert "=> cross_entropy (token mean_valid)" in form  # eager's mean over the labelled tokens
    report = tile_pass.explain(slice_shift, *fp32_inputs())
    assert "slice tokens" in report.rewrites[0].form
    assert report.rewrites[0].num_tokens == B * (T - 1)
    report = tile_pass.explain(log_softmax_nll, *fp32_inputs())
    assert "log_softmax -> nll_loss(ignore_index=-100)" in report.rewrites[0].form


def per_token_scale(h, w, y):
    scale = torch.linspace(0.5, 1.5, B * T, dtype=h.dtype, device=h.device).view(B, T, 1)
    return F.cross_entropy((F.linear(h, w) * scale).view(-1, V), y.view(-1))


def global_centering(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy((logits - logits.mean()).view(-1, V), y.view(-1))  # a mean over every token


def learnable_scale(h, w, y, s):
    return F.cross_entropy((F.linear(h, w) * s).view(-1, V), y.view(-1))


def graph_break_between(h, w, y):
    logits = F.linear(h, w)
    torch._dynamo.graph_break()
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


@pytest.mark.parametrize(
    ("fn", "extra", "reason"),
    [
        (global_centering, (), "reads a value reduced over the tokens"),
        (graph_break_between, (), "a graph break separates the LM head from the loss"),
    ],
    ids=["global_centering", "graph_break"],
)
def test_not_tiled_forms_are_reported_and_exact(fn, extra, reason):
    args = (*inputs("cpu"), *extra)
    report = tile_pass.explain(fn, *args)
    assert not report.rewrites
    assert any(reason in s.reason for s in report.skipped), str(report)
    compare(fn, args, tile_pass.backend("aot_eager"))


def test_learnable_scale_is_differentiated_in_the_tiles():
    args = (*inputs("cpu"), torch.tensor(0.7, dtype=torch.float64, requires_grad=True))
    report = tile_pass.explain(learnable_scale, *args)
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    compare(learnable_scale, args, tile_pass.backend("aot_eager", tile_tokens=8))  # the scale's gradient too


def test_per_token_scale_is_a_per_token_input():
    args = inputs("cpu")
    report = tile_pass.explain(per_token_scale, *args)
    assert len(report.rewrites) == 1, str(report)
    compare(per_token_scale, args, tile_pass.backend("aot_eager"))


# ---------------------------------------------------------------- logits also returned


def returns_logits(h, w, y):
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
    return loss, logits


def capture_backward_graphs(graphs):
    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_returned_logits_exact_and_no_logits_tangent(device, dtype):
    graphs = []
    backend = tile_pass.backend(capture_backward_graphs(graphs), tile_tokens=8, compile_tiles=False)
    compiled = torch.compile(returns_logits, backend=backend)
    h, w, y = inputs(device)
    hc, wc = leaves(h, w, dtype=dtype)[:2]
    loss, logits = compiled(hc, wc, y)
    ref_loss, ref_logits = returns_logits(*leaves(h, w, dtype=dtype), y)
    assert logits.dtype == dtype and logits.requires_grad
    torch.testing.assert_close(logits, ref_logits)  # same op, same dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)
    loss.backward()
    report = backend.report()
    assert "returned exactly" in report.rewrites[0].returned_logits
    assert report.rewrites[0].returned_logits_bytes == B * T * V * logits.element_size()
    n_v = B * T * V
    backward = graphs[-1]
    tangents = [n for n in backward.graph.nodes if n.op == "placeholder" and "tangent" in n.name]
    assert all(n.meta["val"].numel() < n_v for n in tangents), [n.meta["val"].shape for n in tangents]
    assert all(
        n.meta["val"].numel() < n_v
        for n in backward.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_through_returned_logits_is_exact(device):
    """A second loss on the returned logits, computed outside the compiled function."""

    def step(fn):
        def run(h, w, y):
            loss, logits = fn(h, w, y)
            return loss + 0.3 * logits.pow(2).mean() + logits[0, 1, 2]

        return run

    args = inputs(device)
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compiled = torch.compile(returns_logits, backend=backend)
    oracle, oracle_grads = value_and_grads(step(returns_logits), leaves(*args))
    out, grads = value_and_grads(step(compiled), leaves(*args, dtype=torch.float32))
    assert len(backend.report().rewrites) == 1
    assert_close_to_oracle(out, oracle, torch.float32, "loss")
    for g, rg in zip(grads[:2], oracle_grads[:2], strict=True):
        assert_close_to_oracle(g, rg, torch.float32, "grad")


@pytest.mark.parametrize("device", DEVICES)
def test_drop_logits_opt_in(device):
    backend = tile_pass.backend("aot_eager", tile_tokens=8, drop_logits=True)
    compiled = torch.compile(returns_logits, backend=backend)
    h, w, y = inputs(device)
    h, w = h.float(), w.float()
    (loss, logits), (ref_loss, ref_logits) = compiled(*leaves(h, w), y), returns_logits(*leaves(h, w), y)
    torch.testing.assert_close(loss, ref_loss)
    assert logits.shape == ref_logits.shape and logits.dtype == ref_logits.dtype
    assert logits.stride() == (0, 0, 0) and torch.isnan(logits).all()
    report = backend.report()
    assert "dropped" in report.rewrites[0].returned_logits and report.rewrites[0].returned_logits_bytes == 0
    assert "dropped" in str(report)
    compare(lambda a, b, c: returns_logits(a, b, c)[0], (h, w, y), backend)


@pytest.mark.parametrize("device", DEVICES)
def test_returned_softcapped_logits(device):
    """Gemma 2 returns the soft-capped logits and upcasts only for the loss."""

    def gemma_like(h, w, y):
        logits = torch.tanh(F.linear(h, w) / 5.0) * 5.0
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits

    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compare(lambda *a: gemma_like(*a)[0] + gemma_like.__code__.co_argcount * 0, inputs(device), backend)
    compiled = torch.compile(gemma_like, backend=tile_pass.backend("aot_eager", tile_tokens=8))
    h, w, y = inputs(device)
    _, logits = compiled(*leaves(h, w, dtype=torch.float32), y)
    _, ref = gemma_like(*leaves(h, w, dtype=torch.float32), y)
    torch.testing.assert_close(logits, ref)


def test_dynamic_shapes_with_returned_logits_compile_once():
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compiled = torch.compile(returns_logits, backend=backend, dynamic=True)
    for seq in (4, 9, 23, 40):
        g = torch.Generator().manual_seed(seq)
        h = torch.randn(2, seq, H, generator=g, requires_grad=True)
        w = torch.randn(V, H, generator=g, requires_grad=True)
        y = torch.randint(0, V, (2, seq), generator=g)
        loss, logits = compiled(h, w, y)
        ref_loss, ref_logits = returns_logits(h, w, y)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(logits, ref_logits)
        loss.backward()
    assert len(backend.report().graphs) == 1


def returns_logits_and_slices(h, w, y):
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, V), y[:, 1:].reshape(-1))
    return loss, logits


@pytest.mark.parametrize("fn", [returns_logits, returns_logits_and_slices], ids=lambda f: f.__name__)
def test_returned_logits_values_and_gradients(fn):
    """Returned logits written by the tiles (no slice) or recomputed in the graph (slice)."""
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compiled = torch.compile(fn, backend=backend)
    h, w, y = fp32_inputs()

    def objective(f):
        def run(a, b, c):
            loss, logits = f(a, b, c)
            return loss + (logits * torch.linspace(-1, 1, V)).mean()

        return run

    ref, ref_grads = value_and_grads(objective(fn), leaves(h.double(), w.double(), y))
    out, grads = value_and_grads(objective(compiled), leaves(h, w, y))
    assert_close_to_oracle(out, ref, torch.float32, "objective")
    for g, rg in zip(grads[:2], ref_grads[:2], strict=True):
        assert_close_to_oracle(g, rg, torch.float32, "grad")
    handled = backend.report().rewrites[0].returned_logits
    assert ("written by the tiles" in handled) == (fn is returns_logits)


# --------------------------------------------------------------------------------- autocast


def autocast_head_float_loss(h, w, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def autocast_whole_step(h, w, y):  # the loss inside autocast too: autocast runs it in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.view(-1, V), y.view(-1), label_smoothing=0.1)


def autocast_returns_logits(h, w, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


@pytest.mark.parametrize("fn", [autocast_head_float_loss, autocast_whole_step], ids=lambda f: f.__name__)
def test_autocast_head_is_tiled_like_eager_autocast(fn):
    """Under autocast the rewrite casts the projection's inputs as autocast does: the loss and
    gradients equal eager autocast's (same bf16 roundings), far closer than bf16 tolerance."""
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    h, w, y = fp32_inputs()
    eager, eager_grads = value_and_grads(fn, leaves(h, w, y))
    out, grads = value_and_grads(torch.compile(fn, backend=backend), leaves(h, w, y))
    report = backend.report()
    assert len(report.rewrites) == 1 and "autocast(bfloat16)" in report.rewrites[0].form, str(report)
    assert out.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(out, eager, rtol=2e-3, atol=1e-4)
    for g, e in zip(grads[:2], eager_grads[:2], strict=True):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3 * e.abs().max().item())


def test_autocast_with_returned_logits_is_tiled():
    """The returned logits keep autocast's dtype and values; their gradient path replays the
    projection on the cast inputs, so gradients through them reach the float32 leaves."""
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    h, w, y = fp32_inputs()

    def objective(fn):
        def run(h, w, y):
            loss, logits = fn(h, w, y)
            assert logits.dtype == torch.bfloat16
            return loss + logits.float().pow(2).mean()

        return run

    eager, eager_grads = value_and_grads(objective(autocast_returns_logits), leaves(h, w, y))
    compiled = torch.compile(autocast_returns_logits, backend=backend)
    out, grads = value_and_grads(objective(compiled), leaves(h, w, y))
    assert len(backend.report().rewrites) == 1 and not backend.report().skipped, str(backend.report())
    torch.testing.assert_close(out, eager, rtol=2e-3, atol=1e-4)
    for g, e in zip(grads[:2], eager_grads[:2], strict=True):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3 * e.abs().max().item())
