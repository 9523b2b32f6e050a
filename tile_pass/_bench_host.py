"""Host time per step at a shape where the work is nothing: what the pass adds per call and per tile.

``python -m tile_pass.bench --host-overhead``. A one-tile step (``F.cross_entropy(F.linear(h, W), y)``,
N=64, H=32, V=500) does a few microseconds of arithmetic, so its time is the host's: Dynamo's
guards, AOTAutograd's wrappers, the region op's Python and one dispatch per op of each tile. On a
GPU the host must stay ahead of the kernels, and CUDA-graph capture needs that Python gone, so it
is measured here, against plain ``aot_eager`` on the same function, with one thread, the two
interleaved step by step in one process, medians after warm-up. More tiles of the same tokens
(``tile_tokens = N / tiles``) show the cost of one more tile: a tile's GEMMs are per-tile calls.
"""

from __future__ import annotations

import statistics
import time
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


def measure(tiles: tuple[int, ...] = (1, 2, 4, 8), steps: int = 21, warmup: int = 5) -> list[dict[str, Any]]:
    """One row per tile count: the medians of plain ``aot_eager`` and of tile_pass on it, in ms."""
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
            plain = torch.compile(_loss, backend="aot_eager")
            tiled = torch.compile(_loss, backend=tile_pass.backend("aot_eager", tile_tokens=TOKENS // count))
            for _ in range(warmup):
                _step_seconds(plain, h, w, y), _step_seconds(tiled, h, w, y)
            times: dict[str, list[float]] = {"aot_eager": [], "tile_pass": []}
            for _ in range(steps):
                times["aot_eager"].append(_step_seconds(plain, h, w, y))
                times["tile_pass"].append(_step_seconds(tiled, h, w, y))
            plain_ms, tiled_ms = (statistics.median(times[k]) * 1e3 for k in ("aot_eager", "tile_pass"))
            rows.append({"tiles": count, "aot_eager_ms": plain_ms, "tile_pass_ms": tiled_ms,
                         "added_ms": tiled_ms - plain_ms})  # fmt: skip
        return rows
    finally:
        torch.set_num_threads(threads)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table, and the cost of one more tile (the slope from the first row to the last)."""
    lines = [
        f"host time per step: F.cross_entropy(F.linear(h, W), y), N={TOKENS} H={HIDDEN} V={VOCAB}, "
        "one thread, medians of interleaved steps",
        f"{'tiles':>5}  {'aot_eager ms':>12}  {'tile_pass ms':>12}  {'added ms':>8}",
    ]
    for r in rows:
        plain, tiled, added = r["aot_eager_ms"], r["tile_pass_ms"], r["added_ms"]
        lines.append(f"{r['tiles']:>5}  {plain:>12.3f}  {tiled:>12.3f}  {added:>8.3f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        slope = (last["added_ms"] - first["added_ms"]) / (last["tiles"] - first["tiles"])
        lines.append(f"per additional tile: {slope:.3f} ms")
    return "\n".join(lines)
