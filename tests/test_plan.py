"""The one tile plan: what the report says and what the loop runs, and the op boundary's record."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass.plan import _plan
from tile_pass.plan._plan import RegionCall, plan_tiles
from tile_pass.plan._tiling import TileSize
from tile_pass.plan._weight_grad import WeightGradSchedule


@pytest.mark.parametrize("tile", [TileSize(256, True), TileSize(7), TileSize(65536, False)])
@pytest.mark.parametrize("compiled", [False, True])
def test_region_call_key_round_trips(tile, compiled):
    call = RegionCall("rowprog-0123abcd", tile, compiled)
    assert RegionCall.parse(call.key) == call
    assert RegionCall.parse(call.key).key == call.key  # content-addressed: one key per record


def test_plan_is_computed_once_per_shape():
    args = (4096, 4096, TileSize(1024, True), (32000, 512), torch.bfloat16, torch.device("cpu"), False)
    first = plan_tiles(*args)
    assert plan_tiles(*args) is first  # cached: a step pays a lookup
    assert first.num_tiles == -(-4096 // first.tile)
    assert first.tile_bytes == first.tile * first.bytes_per_token
    assert first.schedule is WeightGradSchedule.SPLIT
    assert plan_tiles(*args[:-1], False, need_weight=False).schedule is WeightGradSchedule.FLOAT32


def test_recorded_sees_every_loop_forward_and_backward_and_nests():
    """Per-token log-probabilities: the forward loop makes them, the backward loop re-runs the tiles."""

    def log_probs(h, w, y):
        return F.log_softmax(F.linear(h, w).float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)

    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    y = torch.randint(0, 50, (40,))
    compiled = torch.compile(log_probs, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    with _plan.recorded() as outer:
        out = compiled(h, w, y)
        with _plan.recorded() as inner:
            out.sum().backward()
    assert [(p.rows, p.tile, p.num_tiles) for p in outer] == [(40, 16, 3)] * 2
    assert inner == outer[1:]
    torch.testing.assert_close(out, log_probs(h, w, y))
    with _plan.recorded() as after:
        pass
    assert after == [] and not _plan._observers  # nothing is recorded outside a ``recorded`` block


def test_report_and_loop_agree_without_a_module_global():
    h = torch.randn(300, 16, requires_grad=True)
    w = torch.randn(64, 16, requires_grad=True)
    y = torch.randint(0, 64, (300,))
    backend = tile_pass.backend("aot_eager", tile_tokens=128)
    with _plan.recorded() as plans:
        torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), backend=backend)(h, w, y).backward()
    (rewrite,) = backend.report().rewrites
    (ran,) = plans
    assert (rewrite.tile_tokens, rewrite.num_tiles) == (ran.tile, ran.num_tiles) == (128, 3)
    assert not hasattr(tile_pass.plan._tiling, "last_tiles")


def test_the_region_ops_are_registered_when_tile_pass_is_imported():
    """A graph saved with the ops in it (a dump, an AOT artifact) loads after ``import tile_pass``."""
    import subprocess
    import sys

    code = "import tile_pass, torch; print(sorted(n for n in dir(torch.ops.tile_pass) if 'region' in n))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['row_region', 'row_region_backward', 'row_region_loss']", out


def test_a_new_token_count_reuses_the_traced_tiles_of_its_tile_size(monkeypatch):
    """The functional API in eager code: a new batch length traces at most its short last tile;
    the full tiles' function is the one traced for the first length."""
    from tile_pass.tiles import _tile_function

    traced = []
    real = _tile_function._trace_program_kernel
    spy = lambda key: traced.append(key.tile) or real(key)  # noqa: E731
    monkeypatch.setattr(_tile_function, "_trace_program_kernel", spy)
    w = torch.randn(97, 24, requires_grad=True)
    for n in (301, 333, 365, 301):  # full tiles of 128, then a short one padded to 64 or 128
        h = torch.randn(n, 24, requires_grad=True)
        y = torch.randint(0, 97, (n,))
        tile_pass.linear_cross_entropy(h, w, y, tile_tokens=128).backward()
    assert traced.count(128) <= 1, traced  # the 128-row tile: at most once (none if an earlier test did)
    assert len(traced) <= 2, traced  # and the short tiles' padded sizes, each once
