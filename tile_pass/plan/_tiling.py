"""Tile size from a byte budget.

The byte model the budget is divided by is the ``[tile, V]`` buffers one tile keeps alive
at once, per token of the tile:

* **Compiled tiles** (``compile_tiles``, the default under Inductor): one buffer, the
  logits tile in the model dtype (``s`` bytes per element). Inductor fuses the upcast,
  softmax, loss and logits gradient into one pass per row and stores the gradient over the
  logits it has read (``_tile_kernel._store_grad_over_logits``); the two backward GEMMs
  read it from there. ``bytes_per_token = V * s``.
* **Eager tiles**: the logits tile (``s``), its float32 upcast when a half-precision tile
  is upcast (4), the float32 log-probabilities saved by ``log_softmax`` (4), the float32
  gradient of the logits (4) and, when the model dtype is not float32, that gradient cast
  back (``s``): ``bytes_per_token = V * (s + 4 + 4 + [4 + s if s != 4])``.

The budget divided by that, rounded down to a multiple of 16 tokens and clamped to
``[16, 65536]``, is the largest tile. The sequence length never enters the compiled graph,
so one graph serves every ``N`` under ``dynamic=True`` without guards.

At run time (:func:`effective_tile`), a batch whose logits are small next to the budget is
cut into at least ``MIN_TILES`` tiles of a power-of-two size (but not below
``MIN_AUTO_TILE`` tokens, where GEMMs lose efficiency), so the tiles stay a fraction of the
logits they replace at every size, and on a CPU within the last-level cache where that
leaves ``MIN_AUTO_TILE`` tokens. Large batches use the budget's tile: peak memory is flat
in ``N``. An explicit ``tile_tokens`` is used as given. :class:`TileSize` says which.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

#: Whether compiled tiles store the logits gradient over the logits tile. Inductor before
#: 2.13 miscompiles that in-place store on CPU: it schedules the target-logit gather after
#: the store (wrong losses), or fails with ``KeyError: 'bufN'`` in outer-loop fusion. There
#: the gradient gets its own buffer: exact, one more ``[tile, V]`` buffer per tile (the byte
#: model in :mod:`tile_pass.plan._tiling` counts it).
STORE_GRAD_OVER_LOGITS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)

#: Default budget for the per-tile buffers on CPU. Cache-sized tiles do not help here: the
#: step is GEMM-bound and a GEMM of a few hundred rows streams the whole ``[V, H]`` weight
#: once per tile, so the budget trades memory against the number of weight passes. With the
#: float32 GEMMs on oneDNN (see ``_tile_kernel._onednn_mm``), 256-, 384- and 512-token tiles
#: run a float32 128k-vocabulary step equally fast (docs/benchmarks.md has the sweep), so the
#: budget is the smallest of them: 128 MiB is 256 tokens there (512 for bfloat16), about
#: 1/30 of the memory plain Inductor needs beyond its gradients. (A batch's automatic tile
#: is also kept within the last-level cache where it can be: see :func:`effective_tile`.)
DEFAULT_TILE_BYTES = 128 * 1024 * 1024
#: On an accelerator the budget is this fraction of the free memory, within the bounds below.
GPU_FREE_FRACTION = 1 / 16
GPU_MIN_TILE_BYTES = 256 * 1024 * 1024
GPU_MAX_TILE_BYTES = 4 * 1024 * 1024 * 1024

_MIN_TILE = 16
_MAX_TILE = 65536
#: a batch is cut into at least this many tiles when the budget would allow fewer
MIN_TILES = 8
#: ...but automatic tiles are not made smaller than this: this CPU runs 128-row GEMMs at
#: ~140 GFLOP/s against ~180 for 256 rows and up, and small batches have small logits anyway
MIN_AUTO_TILE = 256


def tile_bytes_per_token(
    vocab_size: int, logits_dtype: torch.dtype, upcast: bool, fused: bool = False
) -> int:
    """Bytes of ``[1, V]`` buffers one token of a tile keeps alive (see module docstring);
    ``fused``: the tile's middle is compiled and writes the gradient over the logits (before
    torch 2.13 the gradient gets a buffer of its own: see ``STORE_GRAD_OVER_LOGITS``)."""
    itemsize = logits_dtype.itemsize  # no host tensor: this runs in every tile loop
    if fused:
        return vocab_size * itemsize * (1 if STORE_GRAD_OVER_LOGITS else 2)
    per_element = itemsize + 4 + 4  # logits, fp32 log-probs, fp32 gradient
    if itemsize != 4:
        per_element += itemsize  # gradient cast back to the model dtype
        if upcast:
            per_element += 4  # fp32 upcast copy of the logits tile
    return vocab_size * per_element


def _free_gpu_memory(device_index: int | None) -> int | None:
    """Free bytes on a CUDA device; ``None`` where there is none (fake CUDA tensors on a
    CPU-only machine)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(device_index)[0]


@torch.compiler.assume_constant_result
def _gpu_tile_bytes(device_index: int | None) -> int:
    """A share of the free memory on a CUDA device, read when the caller runs or, in code that
    Dynamo traces (``linear_cross_entropy`` inside ``torch.compile``), once while tracing:
    the budget is a constant of the compiled graph, as the tile size must be."""
    free = _free_gpu_memory(device_index)
    if free is None:
        return GPU_MIN_TILE_BYTES
    return int(min(GPU_MAX_TILE_BYTES, max(GPU_MIN_TILE_BYTES, free * GPU_FREE_FRACTION)))


def default_tile_bytes(device: torch.device | str | None = None) -> int:
    """The budget when none is given: fixed on CPU, a share of the free memory on a GPU.

    The backend calls this when it rewrites a graph, for the device its example inputs live
    on: the free memory at compile time sizes the tiles of that graph."""
    device = torch.device(device if device is not None else "cpu")
    return _gpu_tile_bytes(device.index) if device.type == "cuda" else DEFAULT_TILE_BYTES


def choose_tile_tokens(
    vocab_size: int,
    logits_dtype: torch.dtype,
    upcast: bool,
    *,
    tile_tokens: int | None = None,
    tile_bytes: int | None = None,
    device: torch.device | str | None = None,
    fused: bool = False,
) -> int:
    """The number of tokens per tile: ``tile_tokens`` if given, else from ``tile_bytes``
    (default: :func:`default_tile_bytes` for ``device``) and the byte model (``fused``:
    compiled tiles, see :func:`tile_bytes_per_token`)."""
    if tile_tokens is not None:
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be a positive integer, got {tile_tokens}")
        return int(tile_tokens)
    budget = default_tile_bytes(device) if tile_bytes is None else int(tile_bytes)
    if budget <= 0:
        raise ValueError(f"tile_bytes must be positive, got {tile_bytes}")
    per_token = tile_bytes_per_token(vocab_size, logits_dtype, upcast, fused)
    tokens = budget // max(per_token, 1) // _MIN_TILE * _MIN_TILE  # rounded down to a multiple
    return max(_MIN_TILE, min(_MAX_TILE, tokens))


class TileSize(NamedTuple):
    """The tile asked for: ``tokens`` as given, or (``automatic``) at most ``tokens``, chosen per
    batch by :func:`effective_tile`. A named tuple, so a rewritten graph can hold it."""

    tokens: int
    automatic: bool = False


def effective_tile(num_tokens: int, size: TileSize, row_bytes: int = 0) -> int:
    """The tile actually run for ``num_tokens`` rows.

    Batches smaller than one tile run in a single tile padded by :func:`padded_rows`, so small
    batches neither pad to a huge tile nor trace a new tile function for every distinct length.
    ``row_bytes``: what one token of a CPU tile keeps alive (:func:`tile_bytes_per_token`; 0 off
    the CPU). An automatic tile then also fits the last-level cache where that leaves it
    ``MIN_AUTO_TILE`` tokens or more: the logits GEMM writes the tile and the middle reads it
    back at once, from the cache instead of memory. On a 2-core AMD EPYC (Zen 3, 32 MiB L3) a
    float32 V=32000 step at N=4096, every token labelled, ran 2.74 s in 256-token tiles (31 MiB)
    against 2.98 s in 512-token ones, interleaved in one process.
    """
    tile = size.tokens
    if size.automatic:
        limit = num_tokens // MIN_TILES
        cache = last_level_cache_bytes() if row_bytes > 0 else None
        if cache is not None:
            limit = min(limit, cache // row_bytes)
        power = MIN_AUTO_TILE
        while power * 2 <= limit:
            power *= 2
        tile = min(tile, power)
    return tile if num_tokens >= tile else min(padded_rows(num_tokens), tile)


@functools.cache
def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache, as Linux lists it under sysfs; ``None`` where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:  # Linux writes KiB: "32768K"
            sizes.append(int(path.read_text().strip().removesuffix("K")) * 1024)
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


#: from this many rows a short tile pads to a quarter-octave size, below it to a power of two
_QUARTER_OCTAVES_FROM = 128


def padded_rows(rows: int) -> int:
    """The rows a short tile (or a batch run as one tile) is padded to: the next of 16, 32,
    64, 128, 160, 192, 224, 256, 320, ... (powers of two, then four sizes an octave).

    Every size is a new tile function to trace, so the sizes must be few whatever the batch
    lengths; but a padding row costs as much as a real one, and a power of two wastes up to
    half the work (a batch of 878 labelled tokens ran as 1024). Four sizes an octave waste
    at most a fifth, and every size from 128 is a multiple of 32 (whole row blocks of the
    middle, :func:`tile_pass.tiles._tile_passes.compiled_middle._middle_block_rows`).
    """
    size = _MIN_TILE
    while size < rows and size < _QUARTER_OCTAVES_FROM:
        size *= 2
    if size >= rows:
        return size
    step = (1 << (rows.bit_length() - 1)) // 4
    return -(-rows // step) * step
