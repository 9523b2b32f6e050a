"""The post-trace passes of the tile function (:mod:`tile_pass.tiles._tile_passes`): the ordered list
and its predicates, then each pass on its own (what it rewrites, and that the tile gives the same
results with it), one section per pass module."""

from __future__ import annotations

import pytest
import torch
from tile_kernels import (
    CASES,
    T,
    V,
    call,
    ce_key,
    graph_calls,
    kernel,
    key_for,
    make_inputs,
    middle_of,
    replace,
    run,
)

import tile_pass
from tile_pass import _caches
from tile_pass.plan import _tiling
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.tiles import _tile_buffers, _tile_kernel, _tile_passes
from tile_pass.tiles._tile_passes import (
    accumulate_in_place,
    compiled_middle,
    huge_pages,
    onednn_gemms,
    shared_logits_buffer,
    split_accumulation,
    upcast_accumulation,
)
from tile_pass.tiles._tile_passes._graph import VIEWS
from tile_pass.tiles._tile_passes.compiled_middle import Compiled
from tile_pass.tiles._tile_passes.onednn_gemms import _onednn_mm, _onednn_mm_transposed, onednn_gemms_apply
from tile_pass.tiles._tile_passes.split_accumulation import _BlockedSplitAccumulate
from tile_pass.tiles._tile_passes.upcast_accumulation import _BlockedUpcastAccumulate

H = 16
aten = torch.ops.aten


needs_onednn = pytest.mark.skipif(
    not onednn_gemms_apply(torch.device("cpu")), reason="this torch build has no oneDNN linear"
)


@pytest.fixture
def fresh_kernels():
    tile_pass.clear_caches()
    yield
    tile_pass.clear_caches()


# ------------------------------------------------------------------------- the list


def _name(tile_pass_module) -> str:
    return tile_pass_module.__name__.rsplit(".", 1)[-1]


ORDER = [accumulate_in_place, shared_logits_buffer, huge_pages, compiled_middle, upcast_accumulation,
         split_accumulation, onednn_gemms]  # fmt: skip


def _applying(key) -> list[str]:
    return [p.run.__module__.rsplit(".", 1)[-1] for p in _tile_passes.TILE_PASSES if p.applies(key)]


def test_passes_are_declared_in_order_with_their_predicates():
    assert [p.run for p in _tile_passes.TILE_PASSES] == [m.run for m in ORDER]
    everything = ce_key(torch.bfloat16, upcast=True, weight_grad=WeightGradSchedule.SPLIT, onednn=True)
    assert _applying(everything) == [_name(m) for m in ORDER]
    eager_tile = key_for(torch.float32, compiled=False)
    assert _applying(eager_tile) == ["accumulate_in_place", "shared_logits_buffer", "huge_pages"]
    off_cpu = replace(key_for(torch.float32), device=torch.device("cuda"))
    assert _applying(off_cpu) == ["accumulate_in_place", "compiled_middle", "upcast_accumulation"]


def test_passes_run_in_the_declared_order(monkeypatch, fresh_kernels):
    ran = []
    passes = [
        p._replace(run=lambda gm, key, p=p: ran.append(p.run) or p.run(gm, key))
        for p in _tile_passes.TILE_PASSES
    ]
    monkeypatch.setattr(_tile_passes, "TILE_PASSES", tuple(passes))
    kernel(ce_key(torch.bfloat16, upcast=True, weight_grad=WeightGradSchedule.SPLIT, onednn=True))
    assert ran == [m.run for m in ORDER]


def _has_accumulate_module(gm) -> bool:
    return any(name.rsplit(".", 1)[-1].startswith("_accumulate_") for name, _ in gm.named_modules())


#: for each pass: a key it applies to, and what it leaves in that key's graph
SIGNATURES = {
    accumulate_in_place: (dict(dtype=torch.float32, compiled=False),
                          lambda gm: graph_calls(gm, aten.addmm_.default)),
    shared_logits_buffer: (dict(dtype=torch.bfloat16, compiled=False),
                           lambda gm: graph_calls(gm, _tile_buffers.mm)),
    huge_pages: (dict(dtype=torch.bfloat16, compiled=False, weight_grad=WeightGradSchedule.DIRECT),
                 lambda gm: len(graph_calls(gm, _tile_buffers.fresh_mm)) == 2),
    compiled_middle: (dict(dtype=torch.float32),
                      lambda gm: isinstance(getattr(gm, "submod_1", None), Compiled)),
    upcast_accumulation: (dict(dtype=torch.bfloat16, upcast=True), _has_accumulate_module),
    split_accumulation: (dict(dtype=torch.bfloat16, upcast=True, weight_grad=WeightGradSchedule.SPLIT),
                         lambda gm: any(isinstance(m, _BlockedSplitAccumulate) for m in gm.modules())),
    onednn_gemms: (dict(dtype=torch.float32, onednn=True), lambda gm: onednn_calls(gm)),
}  # fmt: skip


def onednn_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The GEMMs routed to oneDNN, in graph order (a transposed operand is passed as it is)."""
    modules = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return [n for m in modules for n in m.graph.nodes if n.target in (_onednn_mm, _onednn_mm_transposed)]


@pytest.mark.parametrize("tile_pass_module", ORDER, ids=_name)
def test_each_pass_leaves_a_mark_that_is_gone_without_it(tile_pass_module, monkeypatch, fresh_kernels):
    if tile_pass_module is onednn_gemms and not onednn_gemms_apply(torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN linear")
    options = dict(SIGNATURES[tile_pass_module][0])
    mark = SIGNATURES[tile_pass_module][1]
    key = ce_key(options.pop("dtype"), **options)
    assert mark(kernel(key))
    without = tuple(p for p in _tile_passes.TILE_PASSES if p.run is not tile_pass_module.run)
    monkeypatch.setattr(_tile_passes, "TILE_PASSES", without)
    tile_pass.clear_caches()
    assert not mark(kernel(key))


# ------------------------------------------------------------------- compiled_middle


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
    the gradients, the sums they are added into) is the whole tile's, bit for bit. Only a middle
    that stores the logits gradient over the logits is blocked (its other outputs are a few
    values per token): below torch 2.13, whose Inductor miscompiles that store, the gradient is
    an output of its own (``_tiling.STORE_GRAD_OVER_LOGITS``) and the middle runs whole."""
    options = CASES[case]
    whole = run(key_for(**options))
    assert isinstance(middle_of(key_for(**options)), Compiled)
    monkeypatch.setattr(compiled_middle, "MIDDLE_BLOCK_BYTES", 8 * V * 4)  # blocks of 8 or 16 rows
    tile_pass.clear_caches()
    middle = middle_of(key_for(**options))
    # with a bias the middle adds the bias gradient into its sum: blocks would reorder it
    if options.get("bias") or not _tiling.STORE_GRAD_OVER_LOGITS:
        assert isinstance(middle, Compiled) and not isinstance(middle, compiled_middle._RowBlocked)
    else:
        assert isinstance(middle, compiled_middle._RowBlocked) and middle.rows < T
        assert middle.overwritten is not None
    for got, want in zip(run(key_for(**options)), whole, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    tile_pass.clear_caches()


def test_returned_logits_keep_their_own_buffer():
    """A graph that also returns the logits needs them intact: no overwrite there."""
    key = key_for(torch.float32, returns_logits=True)
    assert middle_of(key).overwritten is None
    hidden, weight, *_ = make_inputs(key)
    kept = run(key)[4]
    torch.testing.assert_close(kept, hidden @ weight.T)


# -------------------------------------------------------------- shared_logits_buffer


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


# ---------------------------------------------------------------- upcast_accumulation


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


def test_half_precision_weight_gradient_is_formed_in_row_blocks(monkeypatch):
    """With blocks of 40 rows, V=96 runs as 40 + 40 + 16 rows: no [V, H] bf16 temporary, and
    the float32 sum equals the eager tile's."""
    monkeypatch.setattr(_tile_kernel, "_cache", _caches.BoundedCache("tile functions", 8))
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


# ----------------------------------------------------------------------- onednn_gemms


@needs_onednn
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-tile"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_float32_gemms_run_through_onednn_and_match_aten(compiled, bias, avx512, monkeypatch, fresh_kernels):
    monkeypatch.setattr(onednn_gemms, "backward_products_on_onednn", lambda: avx512)
    key = key_for(torch.float32, bias=bias, compiled=compiled, onednn=True)
    aten_key = replace(key, onednn=False)
    # the logits GEMM (with its bias) always; the hidden-gradient GEMM on an AVX-512 CPU only,
    # else aten's into a buffer of its own; the in-place weight-gradient addmm_ stays aten's
    routed = onednn_calls(kernel(key))
    assert len(routed) == (2 if avx512 else 1)
    assert routed[0].meta["val"].shape == (key.tile, key.vocab_size)  # the logits
    assert len(graph_calls(kernel(key), _tile_buffers.fresh_mm)) == (0 if avx512 else 1)
    assert not graph_calls(kernel(key), torch.ops.aten.mm.default)
    assert not graph_calls(kernel(key), torch.ops.aten.addmm.default)
    assert len(graph_calls(kernel(key), torch.ops.aten.addmm_.default)) == 1
    assert not onednn_calls(kernel(aten_key))
    for got, want in zip(run(key), run(aten_key), strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_half_precision_gemms_stay_aten():
    key = key_for(torch.bfloat16, upcast=True, onednn=True)
    assert not onednn_calls(kernel(key))


def test_onednn_mm_falls_back_to_aten_where_onednn_does_not_apply():
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(_onednn_mm(a, b), a @ b)
    empty = _onednn_mm(torch.randn(4, 0), torch.randn(0, 5))
    assert empty.shape == (4, 5) and not empty.any()
    a, b, bias = torch.randn(4, 3), torch.randn(5, 3).t(), torch.randn(5)
    torch.testing.assert_close(_onednn_mm(a, b, bias), torch.addmm(bias, a, b))
    # given the transposed operand as it is: oneDNN in float32, aten otherwise
    for x, b_t in ((a, b.t()), (a.double(), b.t().double())):
        torch.testing.assert_close(_onednn_mm_transposed(x, b_t), x @ b_t.t())
        c = bias.to(x.dtype)
        torch.testing.assert_close(_onednn_mm_transposed(x, b_t, c), torch.addmm(c, x, b_t.t()))


# ------------------------------------------------------------------------- huge_pages


def test_only_a_returned_weight_gradient_gets_a_buffer_of_its_own():
    """The only tile's weight gradient (the ``direct`` schedule, returned) is formed into a
    buffer of its own from _tile_buffers.empty (huge pages where it is large enough), as is the
    returned hidden gradient; a weight gradient summed across tiles is not."""
    tile_pass.clear_caches()
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
        tile_pass.clear_caches()


@needs_onednn
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_float32_returned_gradients_get_a_buffer_unless_onednn_makes_them(avx512, monkeypatch, fresh_kernels):
    """oneDNN writes no given buffer: the float32 GEMMs it makes keep their own outputs (the
    logits always, the backward products on an AVX-512 CPU); the returned ones aten makes get
    a buffer of their own."""
    monkeypatch.setattr(onednn_gemms, "backward_products_on_onednn", lambda: avx512)
    direct = replace(key_for(torch.float32, onednn=True), weight_grad=WeightGradSchedule.DIRECT)
    gm = kernel(direct)
    assert len(graph_calls(gm, _tile_buffers.fresh_mm)) == (0 if avx512 else 2)  # dW and dh
    assert len(onednn_calls(gm)) == (3 if avx512 else 1)  # the logits first


# ---------------------------------------------------------------- split_accumulation


def test_compiled_tile_has_no_weight_sized_temporary():
    """The tile adds its weight gradient block by block into the planes: no [V, H] product."""
    key = ce_key(torch.bfloat16, upcast=True, label_smoothing=0.0, weight_grad=WeightGradSchedule.SPLIT,
                 tile=32, hidden=16, vocab=96)  # fmt: skip
    gm = kernel(key)
    blocked = [m for m in gm.modules() if isinstance(m, _BlockedSplitAccumulate)]
    assert len(blocked) == 1
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                val = node.meta.get("val")
                allocates = node.op == "call_function" and node.target not in VIEWS
                if isinstance(val, torch.Tensor) and allocates:
                    assert tuple(val.shape) != (96, 16), node.format_node()
