"""The traced tile function: compiled tiles store the logits gradient over the logits tile,
and CPU float32 tiles run their GEMMs through oneDNN."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_worse_than_eager
from tile_kernels import T, V, call, ce_key, graph_calls, kernel, make_inputs, replace, run

import tile_pass
from tile_pass import _settings, _tile_buffers, _tile_kernel, _tiling
from tile_pass._settings import CPU_GEMM_ENV
from tile_pass._tile_kernel import TileKernelKey
from tile_pass._tile_passes import compiled_middle, upcast_accumulation
from tile_pass._tile_passes.compiled_middle import Compiled
from tile_pass._tile_passes.onednn_gemms import _onednn_mm, onednn_gemms_apply
from tile_pass._tile_passes.upcast_accumulation import _BlockedUpcastAccumulate
from tile_pass._weight_grad import WeightGradSchedule

H = 16


def key_for(dtype, upcast=False, softcap=None, bias=False, returns_logits=False, compiled=True,
            need_hidden=True, onednn=False):  # fmt: skip
    return ce_key(dtype, upcast=upcast, softcap=softcap, bias=bias, returns_logits=returns_logits,
                  compiled=compiled, need_hidden=need_hidden, onednn=onednn)  # fmt: skip


def middle_of(key):
    middle = kernel(key).get_submodule("submod_1")
    assert isinstance(middle, Compiled)
    return middle


CASES = {
    "float32": dict(dtype=torch.float32),
    "bf16-upcast-bias": dict(dtype=torch.bfloat16, upcast=True, bias=True),
    "softcap": dict(dtype=torch.float32, softcap=30.0),
    "no-hidden-grad": dict(dtype=torch.float32, need_hidden=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_middle_overwrites_the_logits_tile_and_matches_eager(case):
    options = CASES[case]
    assert (middle_of(key_for(**options)).overwritten is not None) == _tiling.STORE_GRAD_OVER_LOGITS
    compiled = run(key_for(**options))
    eager = run(key_for(**options, compiled=False))
    tol = dict(rtol=2e-2, atol=2e-2) if options["dtype"] == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for got, want in zip(compiled, eager, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_middle_in_row_blocks_is_the_whole_tiles_middle(case, monkeypatch):
    """On the CPU the compiled middle runs block after block of rows; every output (losses,
    the gradients, the sums they are added into) is the whole tile's, bit for bit."""
    options = CASES[case]
    whole = run(key_for(**options))
    assert isinstance(middle_of(key_for(**options)), Compiled)
    monkeypatch.setattr(compiled_middle, "MIDDLE_BLOCK_BYTES", 8 * V * 4)  # blocks of 8 or 16 rows
    _tile_kernel.clear_caches()
    middle = middle_of(key_for(**options))
    if options.get("bias"):  # the middle adds the bias gradient into its sum: blocks would reorder it
        assert isinstance(middle, Compiled) and not isinstance(middle, compiled_middle._RowBlocked)
    else:
        assert isinstance(middle, compiled_middle._RowBlocked) and middle.rows < T
        assert (middle.overwritten is not None) == _tiling.STORE_GRAD_OVER_LOGITS
    for got, want in zip(run(key_for(**options)), whole, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    _tile_kernel.clear_caches()


def test_returned_logits_keep_their_own_buffer():
    """A graph that also returns the logits needs them intact: no overwrite there."""
    key = key_for(torch.float32, returns_logits=True)
    assert middle_of(key).overwritten is None
    hidden, weight, *_ = make_inputs(key)
    kept = run(key)[4]
    torch.testing.assert_close(kept, hidden @ weight.T)


@pytest.mark.parametrize("compiled", [False, True])
def test_logits_gemm_writes_the_loops_shared_buffer(compiled):
    """On the CPU the logits GEMM of a tile writes into the tile loop's buffer, also where the
    graph returns the logits (the loops copy them out before the next tile); a float32 GEMM
    routed to oneDNN keeps its own."""
    shared = (_tile_buffers.mm, _tile_buffers.addmm)
    for key, expected in [
        (key_for(torch.bfloat16, upcast=True, compiled=compiled), True),
        (key_for(torch.bfloat16, bias=True, compiled=compiled), True),
        (key_for(torch.bfloat16, returns_logits=True, compiled=compiled), True),
        (key_for(torch.float32, compiled=compiled, onednn=onednn_gemms_apply(torch.device("cpu"))), None),
    ]:
        uses = [n for target in shared for n in graph_calls(kernel(key), target)]
        if expected is None:
            expected = not key.onednn
        assert bool(uses) == expected, key


def test_tiles_of_a_loop_share_one_logits_buffer(monkeypatch):
    """Every tile's logits land in the same memory (a short last tile in a prefix of it), the
    buffer is gone when the loop ends, and the loss and gradients are eager's."""
    taken = []
    take = _tile_buffers._take

    def recording_take(*args):
        taken.append(take(*args))
        return taken[-1]

    monkeypatch.setattr(_tile_buffers, "_take", recording_take)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(200, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (200,), generator=g)
    target[:70] = -100  # a fully masked first tile
    inputs = [hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16).requires_grad_()]
    for compile_tiles in (False, True):
        taken.clear()
        loss = tile_pass.linear_cross_entropy(*inputs, target, tile_tokens=48, compile_tiles=compile_tiles)
        grads = torch.autograd.grad(loss, inputs)
        assert len(taken) == 3 and [t.shape[0] for t in taken] == [48, 48, 48]  # 130 labelled rows
        assert len({t.data_ptr() for t in taken}) == 1
        assert getattr(_tile_buffers._local, "buffers", None) is None
        eager_in = [t.detach().clone().requires_grad_() for t in inputs]
        eager = F.cross_entropy(F.linear(*eager_in).float(), target)
        reference_in = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        reference = F.cross_entropy(F.linear(*reference_in), target)
        assert_no_worse_than_eager(loss, eager, reference, "loss")
        for got, e, r in zip(
            grads,
            torch.autograd.grad(eager, eager_in),
            torch.autograd.grad(reference, reference_in),
            strict=True,
        ):
            assert_no_worse_than_eager(got, e, r, "grad")


def test_a_shorter_tile_takes_a_prefix_of_the_shared_buffer():
    with _tile_buffers.shared():
        first = _tile_buffers._take((8, 10), torch.bfloat16, torch.device("cpu"))
        shorter = _tile_buffers._take((3, 10), torch.bfloat16, torch.device("cpu"))
        other_dtype = _tile_buffers._take((3, 10), torch.float32, torch.device("cpu"))
        assert shorter.data_ptr() == first.data_ptr() and shorter.is_contiguous()
        assert other_dtype.data_ptr() != first.data_ptr()
        with _tile_buffers.shared():  # a nested loop has buffers of its own
            assert (
                _tile_buffers._take((8, 10), torch.bfloat16, torch.device("cpu")).data_ptr()
                != first.data_ptr()
            )
        assert (
            _tile_buffers._take((8, 10), torch.bfloat16, torch.device("cpu")).data_ptr() == first.data_ptr()
        )
    outside = [_tile_buffers._take((8, 10), torch.bfloat16, torch.device("cpu")) for _ in range(2)]
    assert outside[0].data_ptr() != outside[1].data_ptr()


def test_half_precision_weight_gradient_is_added_by_a_compiled_kernel():
    """bf16 tile gradient into the float32 sum: one fused Inductor pass, not eager mixed-dtype add_."""
    key = key_for(**CASES["bf16-upcast-bias"])
    modules = dict(kernel(key).named_modules())
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
        if isinstance(k, TileKernelKey) and k.hidden_size == 8 and k.vocab_size == 50
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
    monkeypatch.setattr(upcast_accumulation, "UPCAST_BLOCK_BYTES", 40 * H * 2)
    options = CASES["bf16-upcast-bias"]
    key = key_for(**options)
    blocked = [m for m in kernel(key).modules() if isinstance(m, _BlockedUpcastAccumulate)]
    assert len(blocked) == 1 and blocked[0].rows == 40 and set(blocked[0].adds) == {40, 16}
    compiled = run(key)
    eager = run(key_for(**options, compiled=False))
    for got, want in zip(compiled, eager, strict=True):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-5, atol=1e-5)  # the float32 weight sum


needs_onednn = pytest.mark.skipif(
    not onednn_gemms_apply(torch.device("cpu")), reason="this torch build has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-tile"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_float32_gemms_run_through_onednn_and_match_aten(compiled, bias):
    key = key_for(torch.float32, bias=bias, compiled=compiled, onednn=True)
    aten_key = replace(key, onednn=False)
    # the logits GEMM (with its bias) and the hidden-gradient GEMM; the in-place weight
    # gradient addmm_ stays aten's
    assert len(graph_calls(kernel(key), _onednn_mm)) == 2
    assert not graph_calls(kernel(key), torch.ops.aten.mm.default)
    assert not graph_calls(kernel(key), torch.ops.aten.addmm.default)
    assert len(graph_calls(kernel(key), torch.ops.aten.addmm_.default)) == 1
    assert not graph_calls(kernel(aten_key), _onednn_mm)
    for got, want in zip(run(key), run(aten_key), strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_half_precision_gemms_stay_aten():
    key = key_for(torch.bfloat16, upcast=True, onednn=True)
    assert not graph_calls(kernel(key), _onednn_mm)


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
    kernel(key)
    assert key in list(_tile_kernel._cache)
    tile_pass.clear_caches()
    assert len(_tile_kernel._cache) == 0 and len(_tile_kernel._compiled_adds) == 0
    assert kernel(key) is not None  # rebuilt on next use


def _vm_flags(tensor: torch.Tensor) -> set[str]:
    """The kernel's flags for the mapping that holds ``tensor``'s middle byte (the hint
    covers the whole huge pages inside a buffer, not its unaligned ends)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    flags, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = set(line.split()[1:])
                break
    assert flags is not None
    return flags


huge_pages_apply = pytest.mark.skipif(
    _tile_buffers._madvise() is None, reason="no transparent huge pages to ask for here"
)


@huge_pages_apply
def test_large_buffers_ask_for_huge_pages_small_ones_do_not(monkeypatch, restore_settings):
    large = _tile_buffers.empty((_tile_buffers.HUGE_PAGE_MIN_BYTES // 2 + 4096,), torch.int16, "cpu")
    assert "hg" in _vm_flags(large)
    small = _tile_buffers.zeros((1 << 20,), torch.int16, "cpu")  # may share glibc's heap: no hint
    assert "hg" not in _vm_flags(small) and not small.any()
    monkeypatch.setenv(_settings.HUGE_PAGES_ENV, "off")
    _settings.reload()
    plain = _tile_buffers.empty((_tile_buffers.HUGE_PAGE_MIN_BYTES,), torch.int8, "cpu")
    assert "hg" not in _vm_flags(plain)


def test_a_bad_huge_pages_setting_names_the_values(monkeypatch, restore_settings):
    monkeypatch.setenv(_settings.HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match="TILE_PASS_HUGE_PAGES='yes'.*'on'.*'off'"):
        _settings.reload()


def test_only_a_returned_weight_gradient_gets_a_buffer_of_its_own():
    """The only tile's weight gradient (the ``direct`` schedule, returned) is formed into a
    buffer of its own from _tile_buffers.empty (huge pages where it is large enough), as is the
    returned hidden gradient; a weight gradient summed across tiles is not."""
    _tile_kernel.clear_caches()
    try:
        summed = key_for(torch.bfloat16, upcast=True)
        direct = replace(summed, weight_grad=WeightGradSchedule.DIRECT)
        assert len(graph_calls(kernel(direct), _tile_buffers.fresh_mm)) == 2  # dW and dh
        assert len(graph_calls(kernel(summed), _tile_buffers.fresh_mm)) == 1  # dh
        _, _, grad_weight = call(direct, *make_inputs(direct))
        eager = replace(direct, compiled=False)
        _, _, want = call(eager, *make_inputs(eager))
        torch.testing.assert_close(grad_weight, want, rtol=0, atol=0)
    finally:
        _tile_kernel.clear_caches()
