"""The one tile plan: how many rows a tile loop runs, in tiles of what size, with which
weight-gradient schedule.

``explain`` reports it from the sizes' hints when a graph is rewritten, and the tile loop
asks for it with the batch's real sizes on each call; both ask :func:`plan_tiles`, so a report
and a run on the same sizes agree by construction. The plan depends only on sizes, dtypes and
options, so it is computed once per shape and cached: a step pays a dictionary lookup.

What a loop actually ran (it depends on the labels: the tiles skip ignored tokens) is
observable without a module global: :func:`recorded` collects the plans of the loops run
inside it, as a profiler collects events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch

from tile_pass import _settings
from tile_pass._caches import BoundedCache
from tile_pass.plan._tiling import TileSize, effective_tile, tile_bytes_per_token
from tile_pass.plan._weight_grad import WeightGradSchedule, plan


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """One tile loop: ``rows`` tokens in tiles of ``tile`` (the last one short, padded)."""

    rows: int
    tile: int
    schedule: WeightGradSchedule
    #: bytes of the ``[tile, V]`` buffers one token of a tile keeps alive (the byte model)
    bytes_per_token: int
    #: how many tiles of whole coupled groups ran (tile_pass.tiles._coupled_tiles), each evaluating
    #: a nonlinear loss's gradient at its own outputs; 0: tiles of ``tile`` tokens in order
    coupled: int = 0

    @property
    def num_tiles(self) -> int:
        return self.coupled or -(-self.rows // self.tile)

    @property
    def tile_bytes(self) -> int:
        return self.tile * self.bytes_per_token


def plan_tiles(
    rows: int,
    batch: int,
    size: TileSize,
    weight_shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    compiled: bool,
    need_weight: bool = True,
) -> TilePlan:
    """The plan for ``rows`` tokens of a ``batch``-token batch (the rows the tiles run, after any
    skipped ones) and a ``[V, H]`` head of ``dtype``: the tile of
    :func:`tile_pass.plan._tiling.effective_tile` on the byte model, and the weight-gradient schedule
    of :func:`tile_pass.plan._weight_grad.plan` (which may grow or shrink the tile)."""
    key = (int(rows), int(batch), size, tuple(weight_shape), dtype, device.type, compiled, need_weight,
           _settings.current())  # fmt: skip
    return _plans.get(key) or _plans.put(key, _plan(*key))


#: the plans by sizes, dtypes and options (each is a few numbers: a step pays one lookup)
_plans = BoundedCache("tile plans", 4096)


def _plan(rows, batch, size, weight_shape, dtype, device_type, compiled, need_weight, settings) -> TilePlan:
    per_token = tile_bytes_per_token(weight_shape[0], dtype, dtype != torch.float32, compiled)
    tile = effective_tile(rows, size, per_token if device_type == "cpu" else 0)
    schedule = WeightGradSchedule.FLOAT32
    if need_weight:
        acc = torch.promote_types(torch.float32, dtype)
        tile, schedule = plan(rows, tile, size, weight_shape, dtype, acc, per_token, batch)
    return TilePlan(rows, tile, schedule, per_token)


_observers: list[list[TilePlan]] = []
_observers_lock = threading.Lock()


@contextlib.contextmanager
def recorded() -> Iterator[list[TilePlan]]:
    """``with recorded() as plans: step()``: the plan of every tile loop run inside, in order
    (a backward's loop included, on whichever thread autograd runs it)."""
    plans: list[TilePlan] = []
    with _observers_lock:
        _observers.append(plans)
    try:
        yield plans
    finally:
        with _observers_lock:
            _observers.remove(plans)


def ran(tile_plan: TilePlan) -> None:
    """Called by the tile loop with the plan it runs."""
    if _observers:
        with _observers_lock:
            for plans in _observers:
                plans.append(tile_plan)


@dataclasses.dataclass(frozen=True)
class RegionCall:
    """What a rewritten graph's call of the region ops carries beside tensors: the region's
    program and the plan's constants. It crosses the op boundary as one string (a custom op
    takes primitives), content-addressed: the same region and options give the same key."""

    program: str  # a :func:`tile_pass.program._region.register` key
    tile: TileSize
    compile_tiles: bool

    @property
    def key(self) -> str:
        return f"{self.program}/tile={self.tile.tokens}{'~' if self.tile.automatic else ''}/" + (
            "compiled" if self.compile_tiles else "eager"
        )

    @staticmethod
    def parse(key: str) -> RegionCall:  # uncached: Dynamo traces it where the functional API is compiled
        program, tile, tiles = key.split("/")
        tokens = tile.removeprefix("tile=")
        return RegionCall(
            program, TileSize(int(tokens.rstrip("~")), tokens.endswith("~")), tiles == "compiled"
        )
