"""The traced tile function: its tracing and cache, the tile loop's shared buffers and short
last tile, and the settings the passes read (the passes themselves: tests/test_tile_passes.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_worse_than_eager
from tile_kernels import CASES, V, kernel, key_for

import tile_pass
from tile_pass import _caches, _settings
from tile_pass._settings import CPU_GEMM_ENV
from tile_pass.tiles import _tile_buffers, _tile_kernel
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes.onednn_gemms import onednn_gemms_apply

H = 16


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


def test_short_last_tile_runs_the_next_power_of_two_kernel():
    """84 tokens in tiles of 64: one 64-token tile, then 20 tokens in a 32-token kernel
    (not padded to 64), and the result is still the eager loss."""
    from tile_pass import linear_cross_entropy
    from tile_pass.tiles import _tile_kernel

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
    cache = _caches.BoundedCache("test", 2)
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
