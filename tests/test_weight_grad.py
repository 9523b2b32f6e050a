"""The half-precision weight-gradient sum held as two 16-bit planes: bit-for-bit the float32
schedule's sum, 4 bytes per weight instead of 6, no ``[V, H]`` temporary in the tile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICES, assert_no_worse_than_eager

import tile_pass
from tile_pass import _settings
from tile_pass.plan import _weight_grad
from tile_pass.plan._tiling import TileSize
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.tiles import _split_planes, _split_sum_cpu
from tile_pass.tiles._tile_passes import split_accumulation


@pytest.fixture
def schedule(monkeypatch):
    def use(name):
        monkeypatch.setattr(
            _settings, "_current", dataclasses.replace(_settings.current(), weight_grad_sum=name)
        )

    return use


def special_values(shape, generator):
    x = torch.randn(shape, generator=generator) * torch.logspace(-40, 30, shape[-1]).clamp(max=3e38)
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-42, -1e-42, float("inf"), float("nan")])
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_sum_is_the_float32_sum_bit_for_bit(device, dtype, monkeypatch):
    monkeypatch.setattr(_weight_grad, "BLOCK_BYTES", 7 * 40 * 12)  # several blocks, a short last one
    monkeypatch.setattr(_weight_grad, "_MIN_PRODUCT_BLOCK", 7 * 40 * 2)  # products of 7 rows too
    g = torch.Generator().manual_seed(0)
    shape = (23, 40)
    hi, lo = _split_planes.zeros(shape, device)
    reference = torch.zeros(shape, device=device)
    for step in range(6):
        x = (
            special_values(shape, g).to(device, dtype)
            if step == 2
            else torch.randn(shape, generator=g).to(device, dtype)
        )
        torch.ops.tile_pass.split_accumulate_(hi, lo, x)
        reference.add_(x)
        torch.testing.assert_close(
            _split_planes._as_float32(hi, lo), reference, rtol=0, atol=0, equal_nan=True
        )
    a, b = (
        torch.randn(23, 9, generator=g).to(device, dtype),
        torch.randn(9, 40, generator=g).to(device, dtype),
    )
    assert _weight_grad.product_block_rows(23, 40 * a.element_size()) == 7  # 7 + 7 + 7 + 2 rows
    _split_planes.split_accumulate_mm_(hi, lo, a, b)
    reference.add_(torch.mm(a, b))
    result = _split_planes.finish(hi, lo, dtype)
    assert result.dtype == dtype and result.data_ptr() == hi.data_ptr()  # written over the high plane
    torch.testing.assert_close(result, reference.to(dtype), rtol=0, atol=0, equal_nan=True)


@pytest.fixture(params=["c_loop", "inductor"])
def compiled_kernels(request, monkeypatch):
    """The compiled tiles' plane passes: the C loops (CPU) or the Inductor kernels (every device)."""
    if request.param == "inductor":
        monkeypatch.setattr(_split_sum_cpu, "add", lambda *args: None)
        monkeypatch.setattr(_split_sum_cpu, "finish", lambda *args: None)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [40, 39])  # paired int32 words; an odd row takes the 16-bit path
def test_compiled_split_add_is_the_float32_add_bit_for_bit(device, dtype, width, compiled_kernels):
    """The add a compiled tile runs rounds nowhere, whichever kernel runs it."""
    if compiled_kernels == "c_loop" and device != "cpu":
        pytest.skip("the C loops are the CPU's")
    g = torch.Generator().manual_seed(1)
    shape = (23, width)
    hi, lo = _split_planes.zeros(shape, device)
    scratch = [torch.empty_like(hi), torch.empty_like(lo), torch.empty(shape, dtype=dtype, device=device)]
    add = split_accumulation._compiled_split_add(*scratch)  # tracing runs it on its example inputs
    assert (_split_sum_cpu.add(*scratch) is not None) == (compiled_kernels == "c_loop")
    reference = torch.zeros(shape, device=device)
    for step in range(4):
        x = special_values(shape, g) if step % 2 else torch.randn(shape, generator=g) * 1e3
        x = x.to(device, dtype)
        add(hi, lo, x)
        reference.add_(x)
        torch.testing.assert_close(
            _split_planes._as_float32(hi, lo), reference, rtol=0, atol=0, equal_nan=True
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_rounding_of_the_planes_is_the_eager_rounding(device, dtype, compiled_kernels):
    """The compiled tiles' final rounding gives eager's conversion: ties to even, overflow to
    infinity, subnormals, NaN (as a NaN) and random bit patterns."""
    if compiled_kernels == "c_loop" and device != "cpu":
        pytest.skip("the C loops are the CPU's")
    g = torch.Generator().manual_seed(2)
    shape = (23, 40)
    hi, lo = _split_planes.zeros(shape, device)
    _split_planes.split_add_(hi, lo, special_values(shape, g).to(device))
    bits = torch.randint(-(2**31), 2**31 - 1, (4, 40), generator=g, dtype=torch.int64).to(torch.int32)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x477FF000, 0x477FE000], dtype=torch.int32)  # bf16/fp16 ties
    bits[0, :4] = ties
    hi[:4], lo[:4] = (bits >> 16).to(torch.int16).to(device), bits.to(torch.int16).to(device)
    hi_c, lo_c = hi.clone(), lo.clone()
    expected = _split_planes.finish(hi, lo, dtype)
    got = split_accumulation.finish_split(hi_c, lo_c, dtype, compiled=True)
    assert got.data_ptr() == hi_c.data_ptr() and got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def run(dtype, device, compile_tiles, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 150, 32, 300
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=g)
    if pattern == "uneven_and_masked_tile":
        target[32:64] = -100
        target[64:80] = -100
        target[::7] = -100
    test = [t.to(device, dtype).requires_grad_() for t in (hidden, weight, bias)]
    loss = tile_pass.linear_cross_entropy(
        test[0], test[1], target.to(device), test[2], tile_tokens=32, compile_tiles=compile_tiles
    )
    return loss, torch.autograd.grad(loss * 3.0, test), (hidden, weight, bias, target)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compile_tiles", [False, True])
@pytest.mark.parametrize("pattern", ["all_valid", "uneven_and_masked_tile"])
def test_split_schedule_equals_the_float32_schedule_and_eager(
    device, dtype, compile_tiles, pattern, schedule
):
    schedule("float32")
    loss32, grads32, _ = run(dtype, device, compile_tiles, pattern)
    schedule("split")
    loss, grads, (hidden, weight, bias, target) = run(dtype, device, compile_tiles, pattern)
    assert loss.item() == loss32.item()
    for g, g32 in zip(grads, grads32, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, g32, rtol=0, atol=0)  # the same sum, rounded the same way
    # and within eager's own error against float64
    oracle = [t.to(device).requires_grad_() for t in (hidden, weight, bias)]
    eager_in = [t.to(device, dtype).requires_grad_() for t in (hidden, weight, bias)]

    def eager(h, w, b):
        return torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, w, b).float(), target.to(device)
        )

    ref_grads = torch.autograd.grad(eager(*oracle) * 3.0, oracle)
    eager_grads = torch.autograd.grad(eager(*eager_in) * 3.0, eager_in)
    for name, g, e, r in zip(("hidden", "weight", "bias"), grads, eager_grads, ref_grads, strict=True):
        assert_no_worse_than_eager(g, e, r, f"grad {name}")


def test_schedule_choice_and_its_bytes(schedule):
    split, float32 = WeightGradSchedule.SPLIT, WeightGradSchedule.FLOAT32
    assert _weight_grad.schedule_for(torch.bfloat16) is split
    assert _weight_grad.schedule_for(torch.float16) is split
    assert _weight_grad.schedule_for(torch.float32) is float32
    assert _weight_grad.schedule_for(torch.bfloat16, torch.float64) is float32
    assert _weight_grad.bytes_per_weight(split, torch.bfloat16) == 4
    assert _weight_grad.bytes_per_weight(float32, torch.bfloat16) == 6
    assert _weight_grad.bytes_per_weight(float32, torch.float32) == 4
    assert _weight_grad.bytes_per_weight(WeightGradSchedule.DIRECT, torch.bfloat16) == 2
    schedule("float32")
    assert _weight_grad.schedule_for(torch.bfloat16) is float32


PER_TOKEN, SHAPE = 32000 * 2, (32000, 1024)  # compiled bf16 tiles at V=32000, H=1024


@pytest.mark.parametrize(
    ("num_tokens", "tile", "largest", "dtype", "expected"),
    [
        (100, 128, None, torch.bfloat16, (128, "direct")),  # one tile: no sum across tiles
        # N=1024: 256-token tiles + a 62.5 MiB low plane hold more than one 1024-token tile
        (1024, 256, 2048, torch.bfloat16, (1024, "direct")),
        # the whole batch 125 MiB, split 62.5 + a tile grown to half the low plane (512 tokens)
        (2048, 256, 2048, torch.bfloat16, (512, "split")),
        (1024, 256, None, torch.bfloat16, (256, "split")),  # explicit tiles are kept
        (4096, 256, 4096, torch.bfloat16, (512, "split")),
        (8192, 1024, 2048, torch.bfloat16, (1024, "split")),  # already past half the low plane
        (1024, 256, 2048, torch.float32, (256, "float32")),  # float32 weights: the sum is the gradient
        # past the budget's largest tile (512) but under the plane it would need: one tile
        (1024, 256, 512, torch.bfloat16, (1024, "direct")),
        (1500, 256, 512, torch.bfloat16, (512, "split")),  # padded to 2048: 125 MiB > 62.5 + 15.6
    ],
)
def test_plan_runs_small_half_precision_batches_as_one_tile(num_tokens, tile, largest, dtype, expected):
    size = TileSize(largest, automatic=True) if largest else TileSize(tile)
    planned = _weight_grad.plan(num_tokens, tile, size, SHAPE, dtype, torch.float32, PER_TOKEN)
    assert planned == (expected[0], WeightGradSchedule(expected[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_direct_schedule_is_within_eagers_error(device, monkeypatch):
    """A small batch runs as one tile whose own GEMM rounds the weight gradient once."""
    keys = []
    from tile_pass.tiles import tiled_region

    real = tiled_region._program_kernel
    monkeypatch.setattr(tiled_region, "_program_kernel", lambda key: keys.append(key) or real(key))
    g = torch.Generator().manual_seed(0)
    n, h, v = 150, 32, 300
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    target = torch.randint(0, v, (n,), generator=g)
    target[::7] = -100
    oracle = [t.to(device).requires_grad_() for t in (hidden, weight)]
    eager_in = [t.to(device, torch.bfloat16).requires_grad_() for t in (hidden, weight)]
    test = [t.to(device, torch.bfloat16).requires_grad_() for t in (hidden, weight)]
    target = target.to(device)
    loss = tile_pass.linear_cross_entropy(*test, target)  # automatic tiles: one tile
    assert {k.weight_grad for k in keys} == {WeightGradSchedule.DIRECT} and len(keys) == 1

    def eager(h, w):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), target)

    grads = torch.autograd.grad(loss, test)
    for g_, e, r in zip(
        grads,
        torch.autograd.grad(eager(*eager_in), eager_in),
        torch.autograd.grad(eager(*oracle), oracle),
        strict=True,
    ):
        assert g_.dtype == torch.bfloat16
        assert_no_worse_than_eager(g_, e, r, "grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("first", ["c_store", "zero_then_add"])
def test_unwritten_planes_first_add_is_the_add_into_zeros(dtype, first):
    """Planes of a tile loop start unzeroed: the first blocked product is stored (C loop) or the
    planes are zeroed first; either way every bit is the float32 sum of zeros and the products,
    negative zeros and NaN included, and planes nothing was added into settle to zeros."""
    g = torch.Generator().manual_seed(4)
    shape = (23, 40)
    store = _split_sum_cpu.store(*(torch.empty(shape, dtype=d) for d in (torch.int16, torch.int16, dtype)))
    if first == "c_store":
        assert store is not None
    else:
        store = None
    hi, lo = _split_planes.unwritten_planes(shape, "cpu")
    hi.fill_(12345), lo.fill_(-7)  # whatever the memory held
    reference = torch.zeros(shape)
    for step in range(3):
        a = torch.randn(shape[0], 5, generator=g).to(dtype)
        b = (
            special_values((5, shape[1]), g).to(dtype)
            if step == 0
            else torch.randn(5, shape[1], generator=g).to(dtype)
        )
        product = torch.mm(a, b)
        _split_planes.split_accumulate_mm_(hi, lo, a, b, store=store)
        reference.add_(product)
        torch.testing.assert_close(
            _split_planes._as_float32(hi, lo), reference, rtol=0, atol=0, equal_nan=True
        )
        finite = reference.isfinite()
        assert torch.equal(
            _split_planes._as_float32(hi, lo)[finite].view(torch.int32), reference[finite].view(torch.int32)
        )
    if store is not None:  # the store itself, on special values: 0 + x (a negative zero becomes +0)
        x = special_values(shape, g).to(dtype)
        x[1, :3] = torch.tensor([-0.0, 0.0, -0.0])
        zeros = _split_planes.zeros(shape, "cpu")
        _split_planes.split_add_(*zeros, x)
        stored = [torch.full(shape, -1, dtype=torch.int16), torch.full(shape, -1, dtype=torch.int16)]
        store(*stored, x)
        assert torch.equal(stored[0], zeros[0]) and torch.equal(stored[1], zeros[1])
    _split_planes.settle(hi, lo)  # written: left as they are
    torch.testing.assert_close(_split_planes._as_float32(hi, lo), reference, rtol=0, atol=0, equal_nan=True)
    untouched = _split_planes.unwritten_planes(shape, "cpu")
    untouched[0].fill_(3)
    assert not _split_planes.settle(*untouched)[0].any() and not untouched[1].any()


@pytest.mark.parametrize("rounded", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_last_add_rounds_as_add_then_finish(dtype, rounded):
    """The last tile's add-and-round C loop gives, bit for bit, the add followed by the finish
    pass (ties, overflow, subnormals, NaN and random sums), and only inside ``last_add``."""
    add_and_round = _split_sum_cpu.add_and_round(
        *(torch.empty((1, 40), dtype=d) for d in (torch.int16, torch.int16, dtype)), rounded
    )
    assert add_and_round is not None
    g = torch.Generator().manual_seed(5)
    shape = (23, 40)
    hi, lo = _split_planes.zeros(shape, "cpu")
    _split_planes.split_add_(hi, lo, special_values(shape, g))
    bits = torch.randint(-(2**31), 2**31 - 1, (4, 40), generator=g, dtype=torch.int64).to(torch.int32)
    bits[0, :4] = torch.tensor([0x3F808000, 0x3F818000, 0x477FF000, 0x477FE000], dtype=torch.int32)
    hi[4:8], lo[4:8] = (bits >> 16).to(torch.int16), bits.to(torch.int16)
    a = torch.randn(shape[0], 3, generator=g).to(dtype)
    b = torch.randn(3, shape[1], generator=g).to(dtype)
    a[4:8] = 0  # rows 4-7 keep the sums above: their rounding is the add's

    def planes():
        return [p.clone() for p in (hi, lo)]

    eager = planes()
    _split_planes.split_accumulate_mm_(*eager, a, b)
    eager = _split_planes.finish(*eager, rounded)
    outside = planes()
    _split_planes.split_accumulate_mm_(*outside, a, b, add_and_round=add_and_round)
    assert not _split_planes.rounded_by_last_add(outside[0])  # outside last_add: a plain add
    expected = split_accumulation.finish_split(*outside, rounded, compiled=True)  # the C finish pass

    with _split_planes.last_add(hi):
        _split_planes.split_accumulate_mm_(hi, lo, a, b, add_and_round=add_and_round)
    with pytest.raises(RuntimeError, match="after its last add rounded it"):
        _split_planes.split_accumulate_mm_(hi, lo, a, b, add_and_round=add_and_round)
    got = split_accumulation.finish_split(hi, lo, rounded, compiled=True)
    assert got.data_ptr() == hi.data_ptr() and got.dtype == rounded
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    torch.testing.assert_close(got, eager, rtol=0, atol=0, equal_nan=True)  # NaN stays NaN
    assert not _split_planes.rounded_by_last_add(hi)  # taken by the finish


def test_rounding_marks_do_not_outlive_their_loop(monkeypatch):
    """A ``last_add`` whose tile never added leaves nothing behind, and planes made where a
    loop that raised left its rounded mark start unrounded."""
    shape = (8, 16)
    hi, lo = _split_planes.unwritten_planes(shape, "cpu")
    with _split_planes.last_add(hi):
        pass
    a, b = torch.randn(8, 2).to(torch.bfloat16), torch.randn(2, 16).to(torch.bfloat16)
    add_and_round = _split_sum_cpu.add_and_round(
        hi, lo, torch.empty(shape, dtype=torch.bfloat16), torch.bfloat16
    )
    _split_planes.split_accumulate_mm_(hi, lo, a, b, add_and_round=add_and_round)
    assert not _split_planes.rounded_by_last_add(hi)
    with _split_planes.last_add(hi):
        _split_planes.split_accumulate_mm_(hi, lo, a, b, add_and_round=add_and_round)
    # the loop raises here, before its finish; the next loop's planes take the same memory
    memory = iter([hi, lo])
    monkeypatch.setattr(_split_planes._tile_buffers, "empty", lambda *args: next(memory))
    again, _ = _split_planes.unwritten_planes(shape, "cpu")
    assert again.data_ptr() == hi.data_ptr()
    assert not _split_planes.rounded_by_last_add(again)
