"""The backend on compiled code: canonical forms, inner compilers, dynamic shapes, errors."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads

import tile_pass

B, T = 3, 13  # 39 tokens: with tile 8, the last tile is shorter


def inputs(device, seed=0, batch=B, seq=T, ignore_some=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, models.H, generator=g, dtype=torch.float64)
    w = torch.randn(models.V, models.H, generator=g, dtype=torch.float64) / 4
    y = torch.randint(0, models.V, (batch, seq), generator=g)
    if ignore_some:
        y[0, :9] = -100  # one tile fully masked, uneven counts elsewhere
        y[2, 5:] = -100
        y[1, 2] = 5  # a token equal to the ignore_index of `eight_positional`
    return h.to(device), w.to(device), y.to(device)


def check_compiled(fn, args, inner, device, dtype=torch.float32, tile=8, **compile_kwargs):
    backend = tile_pass.backend(inner, tile_tokens=tile)
    compiled = torch.compile(fn, backend=backend, **compile_kwargs)
    oracle, oracle_grads = value_and_grads(fn, leaves(*args))
    out, grads = value_and_grads(compiled, leaves(*args, dtype=dtype))
    assert_close_to_oracle(out, oracle, dtype, "loss")
    for i, (g, rg) in enumerate(zip(grads, oracle_grads, strict=True)):
        if rg is not None:
            assert_close_to_oracle(g, rg, dtype, f"grad of input {i}")
    return backend.report()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("form", models.FORMS, ids=lambda f: f.__name__)
def test_canonical_forms_are_rewritten_and_exact(form, inner, device):
    report = check_compiled(form, inputs(device), inner, device)
    assert len(report.rewrites) == 1, str(report)
    assert not report.skipped, str(report)
    rewrite = report.rewrites[0]
    assert (rewrite.num_tokens, rewrite.hidden_size, rewrite.vocab_size) == (B * T, models.H, models.V)
    assert rewrite.tile_tokens == 8 and rewrite.num_tiles == 5
    assert "models.py" in rewrite.matmul_source and "models.py" in rewrite.loss_source


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_bias(inner, device):
    h, w, y = inputs(device)
    b = torch.randn(models.V, dtype=torch.float64, device=device)
    report = check_compiled(models.with_bias, (h, w, y, b), inner, device)
    assert len(report.rewrites) == 1 and "bias" in report.rewrites[0].form


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("frozen", ["nothing", "lm_head", "below_head"])
def test_module_training_step(device, tied, frozen):
    """A whole module: every parameter gradient equals eager's, tied or frozen."""
    torch.manual_seed(0)
    model = models.TinyLM(tied=tied).to(device)
    if frozen == "lm_head":
        model.lm_head.weight.requires_grad_(False)
    elif frozen == "below_head":  # LoRA-like: nothing below the head trains
        for p in model.block.parameters():  # (a tied embedding is the head itself)
            p.requires_grad_(False)
        if not tied:
            model.embed.weight.requires_grad_(False)
    tokens = torch.randint(0, models.V, (B, T), device=device)
    labels = inputs(device)[2]
    oracle = copy.deepcopy(model).double()
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compiled = torch.compile(model, backend=backend)

    loss = compiled(tokens, labels)
    (loss * 2.5).backward()
    ref = oracle(tokens, labels)
    (ref * 2.5).backward()
    assert len(backend.report().rewrites) == 1
    assert_close_to_oracle(loss, ref, torch.float32, "loss")
    for (name, p), (_, rp) in zip(model.named_parameters(), oracle.named_parameters(), strict=True):
        assert (p.grad is None) == (rp.grad is None), name
        if p.grad is not None:
            assert_close_to_oracle(p.grad, rp.grad, torch.float32, name)


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_subset(device):
    """A representative subset under the default inner compiler (inductor): one compile."""
    h, w, y = inputs(device)
    b = torch.randn(models.V, dtype=torch.float64, device=device)
    report = check_compiled(models.with_bias, (h, w, y, b), "inductor", device)
    assert len(report.rewrites) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_registered_backend_name(device):
    """``backend="tile_pass"`` works from the entry point alone (inductor inside)."""
    assert "tile_pass" in torch._dynamo.list_backends()
    h, w, y = inputs(device)
    fn = models.none_then_weighted_sum
    compiled = torch.compile(fn, backend="tile_pass")
    oracle, oracle_grads = value_and_grads(fn, leaves(h, w, y))
    out, grads = value_and_grads(compiled, leaves(h, w, y, dtype=torch.float32))
    assert_close_to_oracle(out, oracle, torch.float32, "loss")
    assert_close_to_oracle(grads[1], oracle_grads[1], torch.float32, "grad weight")
    assert tile_pass.default_backend().report().rewrites


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_sequence_lengths_compile_once(device):
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    compiled = torch.compile(models.f_linear_view_float, backend=backend, dynamic=True, fullgraph=True)
    for seq in (5, 17, 40, 123):
        h, w, y = inputs(device, seq=seq)
        oracle, oracle_grads = value_and_grads(models.f_linear_view_float, leaves(h, w, y))
        out, grads = value_and_grads(compiled, leaves(h, w, y, dtype=torch.float32))
        assert_close_to_oracle(out, oracle, torch.float32, f"loss seq={seq}")
        assert_close_to_oracle(grads[0], oracle_grads[0], torch.float32, f"grad hidden seq={seq}")
    report = backend.report()
    assert len(report.graphs) == 1, f"recompiled: {len(report.graphs)} graphs"
    assert len(report.rewrites) == 1
    assert isinstance(report.rewrites[0].num_tokens, str)  # symbolic N


@pytest.mark.parametrize("device", ["cpu"])  # CUDA reports a bad label as a device-side assert
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("bad_label", [models.V, 1000, -3])
def test_label_out_of_range_raises_like_eager(inner, device, bad_label):
    h, w, y = inputs(device)
    y[1, 4] = bad_label
    with pytest.raises(IndexError, match="out of bounds"):
        models.f_linear_view_float(h, w, y)
    compiled = torch.compile(models.f_linear_view_float, backend=tile_pass.backend(inner, tile_tokens=8))
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(h.float(), w.float(), y)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_batch_compiled(device):
    h, w, y = inputs(device)
    y[:] = -100
    report = check_compiled(models.f_linear_view_float, (h, w, y), "aot_eager", device)
    assert len(report.rewrites) == 1


def test_inner_and_option_errors_name_the_fix():
    with pytest.raises(ValueError, match="inner must be one of"):
        tile_pass.backend("nope")
    with pytest.raises(ValueError, match="tile_tokens"):
        tile_pass.backend(tile_tokens=0)
    h, w, y = inputs("cpu")
    with pytest.raises(ValueError, match="target must have shape"):
        tile_pass.linear_cross_entropy(h, w, y[:, :5])
    with pytest.raises(ValueError, match="batch_size"):
        tile_pass.linear_cross_entropy(h, w, y.reshape(-1)[:20])
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # eager's errors (issue 36)
        tile_pass.linear_cross_entropy(h[..., :3], w, y)
    with pytest.raises(RuntimeError, match="same dtype"):
        tile_pass.linear_cross_entropy(h.float(), w, y)
    with pytest.raises(RuntimeError, match="expected target dtype to be Long|expected scalar type Long"):
        tile_pass.linear_cross_entropy(h, w, y.double())  # eager says the latter on torch 2.11


def test_functional_api_inside_compiled_code_fullgraph():
    h, w, y = inputs("cpu")

    def fn(h, w, y):
        return tile_pass.linear_cross_entropy(h, w, y, tile_tokens=8) * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out, grads = value_and_grads(compiled, leaves(h, w, y))
    ref, ref_grads = value_and_grads(
        lambda a, b, c: F.cross_entropy(F.linear(a, b).view(-1, models.V), c.view(-1)) * 2,
        leaves(h, w, y),
    )
    assert_close_to_oracle(out, ref, torch.float64, "loss")
    assert_close_to_oracle(grads[1], ref_grads[1], torch.float64, "grad weight")


# --------------------------------------------------------------- compile modes and options


@pytest.fixture
def inductor_configs(monkeypatch):
    """The Inductor config patches every compile_fx call of the rewritten graph receives."""
    from torch._inductor import compile_fx as compile_fx_module

    seen, real = [], compile_fx_module.compile_fx

    def spy(gm, example_inputs, *args, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, *args, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    return seen


@pytest.mark.parametrize(
    "how",
    ["torch.compile(mode='max-autotune')", "backend(options={'max_autotune': True})"],
)
def test_mode_and_options_reach_the_inner_inductor(how, inductor_configs):
    """They used to raise TypeError at the first call (``mode`` reached the backend as a kwarg)."""
    h, w, y = inputs("cpu")
    h, w = h.float().requires_grad_(), w.float()
    if how.startswith("torch.compile"):
        tile_pass.default_backend().reports.clear()
        compiled = torch.compile(models.f_linear_view_float, backend="tile_pass", mode="max-autotune")
        report = tile_pass.default_backend().report
    else:
        backend = tile_pass.backend(options={"max_autotune": True}, compile_tiles=False)
        assert "options={'max_autotune': True}" in repr(backend)
        compiled = torch.compile(models.f_linear_view_float, backend=backend)
        report = backend.report
    loss = compiled(h, w, y)
    loss.backward()
    torch.testing.assert_close(loss, models.f_linear_view_float(h, w, y))
    assert len(report().rewrites) == 1
    assert any(patches.get("max_autotune") for patches in inductor_configs)


def test_mode_and_options_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="configure Inductor.*inner='aot_eager'"):
        tile_pass.backend("aot_eager", options={"max_autotune": True})
    with pytest.raises(ValueError, match="configure Inductor.*a backend callable"):
        tile_pass.backend(lambda gm, example_inputs: gm.forward, mode="max-autotune")
    with pytest.raises(RuntimeError, match="Unexpected optimization option no_such_option"):
        tile_pass.backend(options={"no_such_option": 1})
    h, w, y = inputs("cpu")
    h, w = h.float(), w.float()
    compiled = torch.compile(
        models.f_linear_view_float, backend=tile_pass.backend("eager"), mode="max-autotune"
    )
    with pytest.raises(Exception, match="configure Inductor.*inner='eager'"):
        compiled(h, w, y)


def test_custom_inner_callable_gets_compiled_tiles():
    """A custom inner compiler used to turn compiled tiles off without a word."""
    assert tile_pass.backend(lambda gm, example_inputs: gm.forward).compile_tiles
    assert not tile_pass.backend("aot_eager").compile_tiles
