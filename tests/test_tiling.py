"""The tile-size model: byte budget, automatic tiles, and the per-device default."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

from tile_pass.plan import _tiling
from tile_pass.plan._tiling import (
    TileSize,
    choose_tile_tokens,
    effective_tile,
    padded_rows,
    tile_bytes_per_token,
)


def test_byte_model_counts_the_documented_buffers():
    assert tile_bytes_per_token(1000, torch.float32, upcast=True) == 1000 * 12
    # bf16 logits + fp32 upcast + fp32 log-probs + fp32 grad + bf16 grad
    assert tile_bytes_per_token(1000, torch.bfloat16, upcast=True) == 1000 * (2 + 4 + 4 + 4 + 2)
    assert tile_bytes_per_token(1000, torch.bfloat16, upcast=False) == 1000 * (2 + 4 + 4 + 2)
    # compiled tiles: the gradient is stored over the logits tile, one buffer in the model dtype
    # (two before torch 2.13, whose Inductor miscompiles the in-place store)
    buffers = 1 if _tiling.STORE_GRAD_OVER_LOGITS else 2
    assert tile_bytes_per_token(1000, torch.float32, upcast=True, fused=True) == 1000 * 4 * buffers
    assert tile_bytes_per_token(1000, torch.bfloat16, upcast=True, fused=True) == 1000 * 2 * buffers
    assert choose_tile_tokens(1000, torch.bfloat16, True, tile_bytes=2000 * 64 * buffers, fused=True) == 64


def test_budget_gives_the_tile():
    assert (
        choose_tile_tokens(32000, torch.float32, True, tile_bytes=64 << 20) == (64 << 20) // 384000 // 16 * 16
    )
    assert choose_tile_tokens(32000, torch.float32, True, tile_tokens=7) == 7
    assert choose_tile_tokens(10**7, torch.float32, True, tile_bytes=1) == 16  # clamped
    with pytest.raises(ValueError, match="tile_tokens"):
        choose_tile_tokens(10, torch.float32, True, tile_tokens=0)


def test_automatic_tiles_shrink_with_the_batch_and_cap_at_the_budget():
    cap = TileSize(688, automatic=True)
    assert effective_tile(1024, cap) == 256  # not below 256 tokens, even if that is < 8 tiles
    assert effective_tile(2048, cap) == 256  # >= 8 tiles
    assert effective_tile(4096, cap) == 512
    assert effective_tile(1 << 20, cap) == 688  # large batches: the budget's tile, flat in N
    assert effective_tile(100, cap) == 128  # one padded tile
    assert effective_tile(40, cap) == 64
    assert effective_tile(1024, TileSize(300)) == 300  # an explicit tile is used as given


def test_automatic_cpu_tiles_stay_within_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(_tiling, "last_level_cache_bytes", lambda: 32 << 20)
    cap, row = TileSize(1024, automatic=True), 32000 * 4  # a float32 V=32000 logits row
    assert effective_tile(4096, cap) == 512  # off the CPU (no row bytes): 8 tiles
    assert effective_tile(4096, cap, row) == 256  # 256 rows are 31 MiB: in the 32 MiB cache
    assert effective_tile(1 << 20, cap, row) == 256  # whatever the batch
    assert effective_tile(4096, cap, 128256 * 4) == 256  # never below MIN_AUTO_TILE
    assert effective_tile(4096, TileSize(1024), row) == 1024  # an explicit tile is used as given
    monkeypatch.setattr(_tiling, "last_level_cache_bytes", lambda: None)  # unknown: no cap
    assert effective_tile(4096, cap, row) == 512


def test_last_level_cache_is_read_from_sysfs_or_unknown():
    size = _tiling.last_level_cache_bytes()
    assert size is None or size >= 1 << 15


@pytest.mark.parametrize("device", DEVICES)
def test_default_budget_per_device(device):
    budget = _tiling.default_tile_bytes(device)
    if device == "cpu":
        assert budget == _tiling.DEFAULT_TILE_BYTES
    else:
        assert _tiling.GPU_MIN_TILE_BYTES <= budget <= _tiling.GPU_MAX_TILE_BYTES


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device with 8 GiB free, as far as the budget can tell."""
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(_tiling, "_free_gpu_memory", lambda device_index: free["bytes"])
    return free


def test_gpu_budget_follows_free_memory_inside_a_backend(fake_gpu, monkeypatch):
    """Inside every backend ``torch.compiler.is_compiling()`` is true; the budget must still be
    the documented share of the free memory, not a fixed floor."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _tiling.default_tile_bytes("cuda") == (8 << 30) // 16
    fake_gpu["bytes"] = 1 << 30  # 1/16 of it is below the floor
    assert _tiling.default_tile_bytes("cuda:0") == _tiling.GPU_MIN_TILE_BYTES
    fake_gpu["bytes"] = 1 << 40
    assert _tiling.default_tile_bytes(torch.device("cuda", 0)) == _tiling.GPU_MAX_TILE_BYTES
    fake_gpu["bytes"] = 8 << 30
    tokens = choose_tile_tokens(32000, torch.bfloat16, True, device="cuda", fused=True)
    buffers = 1 if _tiling.STORE_GRAD_OVER_LOGITS else 2  # the compiled tile's [tile, V] buffers
    assert tokens == ((8 << 30) // 16 // (32000 * 2 * buffers)) // 16 * 16


def test_gpu_budget_is_read_once_when_dynamo_traces_the_functional_api(fake_gpu):
    """In traced code the budget becomes a constant of the graph (no graph break)."""
    torch._dynamo.reset()
    traced = torch.compile(lambda x: x * _tiling.default_tile_bytes("cuda"), backend="eager", fullgraph=True)
    assert traced(torch.ones(())).item() == (8 << 30) // 16


def test_short_tiles_pad_to_few_sizes_and_little_padding():
    """Short tiles pad to powers of two up to 128 rows, then to four sizes an octave: at most
    a fifth of padding, every size a multiple of 32 rows, and few sizes whatever the lengths."""
    assert [padded_rows(n) for n in (1, 16, 17, 100, 128, 129, 219, 256, 257, 878, 1024, 1500)] == [
        16, 16, 32, 128, 128, 160, 224, 256, 320, 896, 1024, 1536,
    ]  # fmt: skip
    sizes = {padded_rows(n) for n in range(1, 4097)}
    assert len(sizes) == 4 + 4 * 5  # 16..128, then 4 an octave up to 4096
    for n in range(128, 4097):
        size = padded_rows(n)
        assert n <= size < n * 1.25 and size % 32 == 0
    assert effective_tile(219, TileSize(512)) == 224 and effective_tile(878, TileSize(1024)) == 896
