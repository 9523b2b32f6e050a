"""The traced tile function: compiled tiles store the logits gradient over the logits tile,
and CPU float32 tiles run their GEMMs through oneDNN."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import tile_pass
from tile_pass import _settings, _tile_kernel
from tile_pass._settings import CPU_GEMM_ENV
from tile_pass._tile_kernel import (
    KernelKey,
    LossHead,
    _BlockedUpcastAccumulate,
    _Compiled,
    _onednn_mm,
    onednn_gemms_apply,
    tile_kernel,
)

T, H, V = 32, 16, 96


def key_for(
    dtype,
    ops=(),
    constants=(),
    bias=False,
    keep_logits_after=-1,
    compiled=True,
    need_hidden=True,
    onednn=False,
):
    return KernelKey(
        head=LossHead(tuple(ops), ignore_index=-100, label_smoothing=0.1, constants=constants),
        tile=T,
        hidden_size=H,
        vocab_size=V,
        hidden_dtype=dtype,
        weight_dtype=dtype,
        bias_dtype=dtype if bias else None,
        target_dtype=torch.int64,
        extras=(),
        device=torch.device("cpu"),
        need_hidden=need_hidden,
        need_weight=True,
        need_bias=bias,
        acc_dtype=torch.float32,
        keep_logits_after=keep_logits_after,
        compiled=compiled,
        onednn=onednn,
    )


def make_inputs(key, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = key.hidden_dtype
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = torch.randn(V, H, generator=gen).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype) if key.bias_dtype is not None else None
    target = torch.randint(0, V, (T,), generator=gen)
    target[::5] = -100
    coef = torch.rand(T, generator=gen)
    weight_acc = torch.randn(V, H, generator=gen)  # accumulation adds to what is there
    bias_acc = torch.randn(V, generator=gen) if bias is not None else None
    return hidden, weight, bias, target, [], coef, weight_acc, bias_acc


def run(key):
    """(losses, grad hidden, weight sum, bias sum, kept logits) of one tile."""
    inputs = make_inputs(key)
    losses, grad_hidden, kept, _ = tile_kernel(key)(*inputs)
    return losses, grad_hidden, inputs[6], inputs[7], kept


def middle_of(key):
    middle = tile_kernel(key).graph_module.get_submodule("submod_1")
    assert isinstance(middle, _Compiled)
    return middle


CASES = {
    "float32": dict(dtype=torch.float32),
    "bf16-upcast-bias": dict(dtype=torch.bfloat16, ops=(("cast", "float32"),), bias=True),
    "softcap": dict(dtype=torch.float32, ops=(("div", 0), ("tanh",), ("mul", 0)), constants=(30.0,)),
    "no-hidden-grad": dict(dtype=torch.float32, need_hidden=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_middle_overwrites_the_logits_tile_and_matches_eager(case):
    options = CASES[case]
    assert (middle_of(key_for(**options)).overwritten is not None) == _tile_kernel.STORE_GRAD_OVER_LOGITS
    compiled = run(key_for(**options))
    eager = run(key_for(**options, compiled=False))
    tol = dict(rtol=2e-2, atol=2e-2) if options["dtype"] == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for got, want in zip(compiled, eager, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got.float(), want.float(), **tol)


def test_returned_logits_keep_their_own_buffer():
    """A graph that also returns the logits needs them intact: no overwrite there."""
    key = key_for(torch.float32, keep_logits_after=0)
    assert middle_of(key).overwritten is None
    hidden, weight, *_ = make_inputs(key)
    kept = run(key)[4]
    torch.testing.assert_close(kept, hidden @ weight.T)


def test_half_precision_weight_gradient_is_added_by_a_compiled_kernel():
    """bf16 tile gradient into the float32 sum: one fused Inductor pass, not eager mixed-dtype add_."""
    key = key_for(**CASES["bf16-upcast-bias"])
    modules = dict(tile_kernel(key).graph_module.named_modules())
    assert any(name.rsplit(".", 1)[-1].startswith("_accumulate_") for name in modules)
    eager_adds = [
        node
        for module in modules.values()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target is torch.ops.aten.add_.Tensor
        and node.args[0].meta["val"].dtype != node.args[1].meta["val"].dtype
    ]
    assert not eager_adds


def test_short_last_tile_runs_the_next_power_of_two_kernel():
    """84 tokens in tiles of 64: one 64-token tile, then 20 tokens in a 32-token kernel
    (not padded to 64), and the result is still the eager loss."""
    from tile_pass import _tile_kernel, linear_cross_entropy

    hidden = torch.randn(84, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (84,))
    loss = linear_cross_entropy(hidden, weight, target, tile_tokens=64)
    tiles = {
        k.tile
        for k in _tile_kernel._cache
        if isinstance(k, _tile_kernel.KernelKey) and k.hidden_size == 8 and k.vocab_size == 50
    }
    assert {64, 32} <= tiles and 128 not in tiles
    expected = torch.nn.functional.cross_entropy(hidden @ weight.T, target)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_half_precision_weight_gradient_is_formed_in_row_blocks(monkeypatch):
    """With blocks of 40 rows, V=96 runs as 40 + 40 + 16 rows: no [V, H] bf16 temporary, and
    the float32 sum equals the eager tile's."""
    monkeypatch.setattr(_tile_kernel, "_cache", _tile_kernel._BoundedCache(8))
    monkeypatch.setattr(_tile_kernel, "UPCAST_BLOCK_BYTES", 40 * H * 2)
    options = CASES["bf16-upcast-bias"]
    key = key_for(**options)
    blocked = [m for m in tile_kernel(key).graph_module.modules() if isinstance(m, _BlockedUpcastAccumulate)]
    assert len(blocked) == 1 and blocked[0].rows == 40 and set(blocked[0].adds) == {40, 16}
    compiled = run(key)
    eager = run(key_for(**options, compiled=False))
    for got, want in zip(compiled, eager, strict=True):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-5, atol=1e-5)  # the float32 weight sum


def graph_calls(kernel, target):
    modules = [m for m in kernel.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    return [n for m in modules for n in m.graph.nodes if n.target is target]


needs_onednn = pytest.mark.skipif(
    not onednn_gemms_apply(torch.device("cpu")), reason="this torch build has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-tile"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_float32_gemms_run_through_onednn_and_match_aten(compiled, bias):
    key = key_for(torch.float32, bias=bias, compiled=compiled, onednn=True)
    aten_key = dataclasses.replace(key, onednn=False)
    # the logits GEMM (with its bias) and the hidden-gradient GEMM; the in-place weight
    # gradient addmm_ stays aten's
    assert len(graph_calls(tile_kernel(key), _onednn_mm)) == 2
    assert not graph_calls(tile_kernel(key), torch.ops.aten.mm.default)
    assert not graph_calls(tile_kernel(key), torch.ops.aten.addmm.default)
    assert len(graph_calls(tile_kernel(key), torch.ops.aten.addmm_.default)) == 1
    assert not graph_calls(tile_kernel(aten_key), _onednn_mm)
    for got, want in zip(run(key), run(aten_key), strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_half_precision_gemms_stay_aten():
    key = key_for(torch.bfloat16, ops=(("cast", "float32"),), onednn=True)
    assert not graph_calls(tile_kernel(key), _onednn_mm)


def test_onednn_mm_falls_back_to_aten_where_onednn_does_not_apply():
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(_onednn_mm(a, b), a @ b)
    empty = _onednn_mm(torch.randn(4, 0), torch.randn(0, 5))
    assert empty.shape == (4, 5) and not empty.any()
    a, b, bias = torch.randn(4, 3), torch.randn(5, 3).t(), torch.randn(5)
    torch.testing.assert_close(_onednn_mm(a, b, bias), torch.addmm(bias, a, b))


@pytest.fixture
def restore_settings(monkeypatch):
    monkeypatch.setattr(_settings, "_current", _settings.current())


def test_cpu_gemm_choice_comes_from_the_environment_once(monkeypatch, restore_settings):
    before = onednn_gemms_apply(torch.device("cpu"))
    monkeypatch.setenv(CPU_GEMM_ENV, "aten")
    assert onednn_gemms_apply(torch.device("cpu")) == before  # read at import, not per call
    _settings.reload()
    assert not onednn_gemms_apply(torch.device("cpu"))
    monkeypatch.setenv(CPU_GEMM_ENV, "onednn")
    assert not onednn_gemms_apply(torch.device("cpu"))
    _settings.reload()
    assert not onednn_gemms_apply(torch.device("meta"))
    monkeypatch.delenv(CPU_GEMM_ENV)
    monkeypatch.setattr(_settings.platform, "machine", lambda: "aarch64")
    _settings.reload()
    assert not onednn_gemms_apply(torch.device("cpu"))  # the default only where it was measured


def test_a_bad_cpu_gemm_setting_fails_at_import_not_in_a_step(monkeypatch, restore_settings):
    monkeypatch.setenv(CPU_GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="TILE_PASS_CPU_GEMM='mkl'.*'onednn'.*'aten'"):
        _settings.reload()
    assert _settings.current().cpu_gemm in ("onednn", "aten")  # the previous settings stand
    onednn_gemms_apply(torch.device("cpu"))  # and a step does not raise
    result = subprocess.run(
        [sys.executable, "-c", "import tile_pass"], env=dict(os.environ), capture_output=True, text=True
    )
    assert result.returncode != 0 and "TILE_PASS_CPU_GEMM='mkl'" in result.stderr


def test_kernel_caches_are_bounded_and_clearable(monkeypatch):
    cache = _tile_kernel._BoundedCache(2)
    for i in range(5):
        cache.put(i, str(i))
    cache.get(3)
    cache.put(5, "5")
    assert list(cache) == [3, 5] and cache.get(0) is None
    key = key_for(**CASES["float32"], compiled=False)
    tile_kernel(key)
    assert key in list(_tile_kernel._cache)
    tile_pass.clear_caches()
    assert len(_tile_kernel._cache) == 0 and len(_tile_kernel._compiled_adds) == 0
    assert tile_kernel(key) is not None  # rebuilt on next use
