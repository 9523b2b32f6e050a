"""Host time per step at a shape where the work is nothing: what the pass adds per call and per tile.

``python -m tile_pass.bench --host-overhead``. A one-tile step (``F.cross_entropy(F.linear(h, W), y)``,
N=64, H=32, V=500) does a few microseconds of arithmetic, so its time is the host's: Dynamo's
guards, AOTAutograd's wrappers, the region op's Python and one dispatch per op of each tile. On a
GPU the host must stay ahead of the kernels, and CUDA-graph capture needs that Python gone, so it
is measured here, against plain ``aot_eager`` on the same function, with one thread, the two
interleaved step by step in one process, medians after warm-up. More tiles of the same tokens
(``tile_tokens = N / tiles``) show the cost of one more tile: a tile's GEMMs are per-tile calls.
A step is forward and backward; the forward alone is timed too (tile_pass forms the gradients
there, so its backward is a scaling). Each backend compiles its own copy of the function, as a
user compiles one: sharing one code object would make each call test the other's guards first.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Any

import torch
import torch.nn.functional as F

#: the shape of the issue that asked for this measurement: one tile of the whole batch
TOKENS, HIDDEN, VOCAB = 64, 32, 500


def _loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w), y)


def _step_seconds(fn, h, w, y) -> float:
    start = time.perf_counter()
    fn(h, w, y).backward()
    return time.perf_counter() - start


def _forward_seconds(fn, h, w, y) -> float:
    start = time.perf_counter()
    fn(h, w, y)
    return time.perf_counter() - start


def _own_copy(fn, name: str):
    """``fn`` with a code object of its own: Dynamo keeps its compiled entries on the code."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def measure(
    tiles: tuple[int, ...] = (1, 2, 4, 8), steps: int = 101, warmup: int = 10
) -> list[dict[str, Any]]:
    """One row per tile count: the medians of plain ``aot_eager`` and of tile_pass on it, in ms,
    of a step (``*_ms``) and of its forward alone (``*_forward_ms``)."""
    import tile_pass

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(TOKENS, HIDDEN, generator=g, requires_grad=True)
        w = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
        y = torch.randint(0, VOCAB, (TOKENS,), generator=g)
        rows = []
        for count in tiles:
            torch._dynamo.reset()
            compiled = {
                "aot_eager": torch.compile(_own_copy(_loss, "_plain_loss"), backend="aot_eager"),
                "tile_pass": torch.compile(
                    _own_copy(_loss, "_tiled_loss"),
                    backend=tile_pass.backend("aot_eager", tile_tokens=TOKENS // count),
                ),
            }
            times: dict[tuple[str, str], list[float]] = {}
            for step in range(warmup + steps):
                for timed in (_step_seconds, _forward_seconds):
                    for name, fn in compiled.items():
                        seconds = timed(fn, h, w, y)
                        if step >= warmup:
                            times.setdefault((name, timed.__name__), []).append(seconds)
            row: dict[str, Any] = {"tiles": count}
            for suffix, timed in (("_ms", _step_seconds), ("_forward_ms", _forward_seconds)):
                for name in compiled:
                    row[name + suffix] = statistics.median(times[(name, timed.__name__)]) * 1e3
                row["added" + suffix] = row["tile_pass" + suffix] - row["aot_eager" + suffix]
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(threads)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table, and the cost of one more tile (the slope from the first row to the last)."""
    lines = [
        f"host time per step: F.cross_entropy(F.linear(h, W), y), N={TOKENS} H={HIDDEN} V={VOCAB}, "
        "one thread, medians of interleaved steps (forward and backward; the forward alone)",
        f"{'tiles':>5}  {'aot_eager ms':>12}  {'tile_pass ms':>12}  {'added ms':>8}"
        f"  {'fwd: aot_eager':>14}  {'tile_pass':>9}  {'added':>6}",
    ]
    for r in rows:
        step = f"{r['aot_eager_ms']:>12.3f}  {r['tile_pass_ms']:>12.3f}  {r['added_ms']:>8.3f}"
        plain, tiled, added = r["aot_eager_forward_ms"], r["tile_pass_forward_ms"], r["added_forward_ms"]
        forward = f"{plain:>14.3f}  {tiled:>9.3f}  {added:>6.3f}"
        lines.append(f"{r['tiles']:>5}  {step}  {forward}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        slope = (last["added_ms"] - first["added_ms"]) / (last["tiles"] - first["tiles"])
        lines.append(f"per additional tile: {slope:.3f} ms")
    return "\n".join(lines)
