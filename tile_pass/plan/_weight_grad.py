"""The weight-gradient sum across tiles for half-precision weights, in 4 bytes per weight.

Each tile adds its ``[V, H]`` weight-gradient contribution into a float32 sum, rounded once
at the end into the model dtype, as one eager GEMM with float32 accumulation would round.
Held as one float32 ``[V, H]`` tensor, that sum plus the returned half-precision gradient
is 6 bytes per weight at the end of the loop: at Llama-3-8B's head, 3 GiB.

The *split* schedule holds the same float32 sum as two 16-bit planes: ``hi``, the upper
16 bits of each float32, and ``lo``, the lower 16. Every add reconstructs the float32 value
exactly (``hi << 16 | lo``), adds the tile's contribution in float32 and splits the result
again, so every partial sum is bit-for-bit the float32 schedule's. At the end the rounded
result in the model dtype (bfloat16 or float16, 16 bits) is written over ``hi`` in place,
element by element, and ``lo`` is freed: 4 bytes per weight at the peak, the returned
gradient included, and 2 after.

Nothing here is a gradient formula: the contributions come from the derived tile
function; this only changes how their float32 sum is stored.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator

import torch

from tile_pass import _settings
from tile_pass.plan._tiling import MIN_AUTO_TILE, TileSize, padded_rows
from tile_pass.tiles import _tile_buffers

#: Rows of a ``[V, H]`` plane handled at a time: bounds the int32/float32 temporaries of the
#: eager implementation and the product block of :func:`split_accumulate_mm_`.
BLOCK_BYTES = 8 * 1024 * 1024
#: A product block is at most 1/16 of the plane (and no smaller than 1 MiB): a small head's
#: block then holds little next to its planes, while every block costs a GEMM call on a strided
#: slice (fewer, larger blocks are faster: 2 MiB blocks of a 128256 x 1024 head take 0.45 s
#: more per step than 8 MiB ones on a 2-core Xeon).
_PRODUCT_BLOCKS = 16
_MIN_PRODUCT_BLOCK = 1024 * 1024


def product_block_rows(rows: int, row_bytes: int) -> int:
    """Rows of the weight-gradient product formed at a time, for a ``[rows, H]`` weight whose
    product rows take ``row_bytes`` each."""
    block = min(BLOCK_BYTES, max(_MIN_PRODUCT_BLOCK, rows * row_bytes // _PRODUCT_BLOCKS))
    return max(1, block // max(1, row_bytes))


class WeightGradSchedule(enum.Enum):
    """How the tiles form the weight gradient."""

    FLOAT32 = "float32"  #: summed across tiles in one ``acc_dtype`` tensor
    SPLIT = "split"  #: summed across tiles in two 16-bit planes of a float32 sum
    DIRECT = "direct"  #: formed by the only tile's GEMM and returned as it is


def schedule_for(weight_dtype: torch.dtype, acc_dtype: torch.dtype = torch.float32) -> WeightGradSchedule:
    """``SPLIT`` for 16-bit weights summed in float32 (it holds 4 bytes per weight instead of 6
    and moves as many bytes per add), ``FLOAT32`` otherwise (the sum is the gradient's own
    dtype, or float64). ``TILE_PASS_WEIGHT_GRAD_SUM`` overrides it for 16-bit weights."""
    if weight_dtype not in (torch.bfloat16, torch.float16) or acc_dtype != torch.float32:
        return WeightGradSchedule.FLOAT32
    chosen = _settings.current().weight_grad_sum
    return WeightGradSchedule.SPLIT if chosen == "auto" else WeightGradSchedule(chosen)


def bytes_per_weight(schedule: WeightGradSchedule, weight_dtype: torch.dtype) -> int:
    """Bytes per weight the weight-gradient sum and the returned gradient hold at the end of
    the tile loop (what ``explain`` and the byte model report)."""
    itemsize = weight_dtype.itemsize
    if schedule is WeightGradSchedule.DIRECT:  # the only tile's gradient is the returned one
        return itemsize
    if schedule is WeightGradSchedule.SPLIT:
        return 4
    acc = max(4, itemsize)
    return acc + (itemsize if itemsize != acc else 0)


#: automatic tiles that are shrunk to fit the half-of-unfused bound stay multiples of this and
#: no smaller than :data:`tile_pass.plan._tiling.MIN_AUTO_TILE`
_TILE_STEP = 64


def plan(
    num_tokens: int,
    tile: int,
    size: TileSize,
    weight_shape: tuple[int, int],
    weight_dtype: torch.dtype,
    acc_dtype: torch.dtype,
    tile_bytes_per_token: int,
    batch_tokens: int | None = None,
) -> tuple[int, WeightGradSchedule]:
    """The tile and the weight-gradient schedule for a batch of ``num_tokens`` run in tiles of
    ``tile`` (:func:`tile_pass.plan._tiling.effective_tile` of the ``size`` asked for).

    For half-precision weights (under the split schedule), a batch that runs as one tile needs
    no sum across tiles: the tile's own GEMM forms the weight gradient with float32
    accumulation and rounds it once, as eager does (``direct``). Float32 weights keep their
    in-place sum, which is the gradient itself.
    With automatic tiles (``size.automatic``) a half-precision batch also runs as one tile
    when that holds fewer bytes than the split sum's low plane plus the smaller tiles:
    ``P * per_token < 2 * V * H + tile * per_token`` (``P``: the batch padded by
    :func:`tile_pass.plan._tiling.padded_rows`). That is the small batches, where the logits are
    small next to the head; the budget bounds the tiles of the split schedule, and this one
    tile holds less than they do with the plane they need, so it may exceed the budget. Under
    the split schedule the automatic tile is no smaller than it need be: each tile reads and
    writes both planes once, so a tile of a quarter of a small batch grows (by powers of two,
    to at least two tiles, within the budget) until it holds half the low plane, where the
    planes still dominate the bytes.

    Then, given the batch's token count (``batch_tokens``, labelled or not), the tile shrinks
    (in steps of 64 tokens, to no fewer than 256) until the step holds at most half of what the
    unfused step would (:func:`held_bytes` against :func:`unfused_bytes`), where such a tile
    exists: from a few thousand tokens the planes leave room for a tile under that bound.
    """
    schedule = schedule_for(weight_dtype, acc_dtype)
    if schedule is not WeightGradSchedule.SPLIT:  # float32 weights: the sum is the gradient; or asked for
        return tile, schedule
    if num_tokens <= tile:
        return tile, WeightGradSchedule.DIRECT
    if not size.automatic:
        return tile, schedule
    padded = padded_rows(num_tokens)
    low_plane = 2 * weight_shape[0] * weight_shape[1]
    if padded * tile_bytes_per_token < low_plane + tile * tile_bytes_per_token:
        return padded, WeightGradSchedule.DIRECT
    # every tile costs one pass over the planes (10 bytes per weight): the tile grows, within
    # the budget and to at least two tiles, until it holds half the low plane
    cap = min(size.tokens, low_plane // 2 // max(1, tile_bytes_per_token))
    while tile * 2 <= cap and tile * 2 <= num_tokens // 2:
        tile *= 2
    if batch_tokens is not None:
        tile = _within_half_of_unfused(tile, batch_tokens, weight_shape, weight_dtype, tile_bytes_per_token)
    return tile, schedule


def unfused_bytes(
    batch_tokens: int, weight_shape: tuple[int, int], itemsize: int, tile_bytes_per_token: int
) -> int:
    """What the unfused step holds at its peak: the logits of every token (in the tiles' dtype,
    ``tile_bytes_per_token`` per token) and the returned weight and hidden gradients."""
    vocab, hidden = weight_shape
    return batch_tokens * tile_bytes_per_token + (vocab + batch_tokens) * hidden * itemsize


def held_bytes(
    tile: int, batch_tokens: int, weight_shape: tuple[int, int], itemsize: int, tile_bytes_per_token: int
) -> int:
    """What the split schedule holds at its peak: the returned gradients (the high plane is the
    weight's), the low plane, one tile's buffers, one block of the weight-gradient product and
    the tile's hidden rows and their gradient."""
    vocab, hidden = weight_shape
    returned = (vocab + batch_tokens) * hidden * itemsize
    product_block = product_block_rows(vocab, hidden * itemsize) * hidden * itemsize
    tile_buffers = tile * tile_bytes_per_token + product_block + 2 * tile * hidden * itemsize
    return returned + 2 * vocab * hidden + tile_buffers


def _within_half_of_unfused(tile, batch_tokens, weight_shape, weight_dtype, tile_bytes_per_token) -> int:
    itemsize = weight_dtype.itemsize
    bound = unfused_bytes(batch_tokens, weight_shape, itemsize, tile_bytes_per_token) // 2
    shrunk = tile
    while (
        shrunk > MIN_AUTO_TILE
        and held_bytes(shrunk, batch_tokens, weight_shape, itemsize, tile_bytes_per_token) > bound
    ):
        shrunk = max(MIN_AUTO_TILE, (shrunk - 1) // _TILE_STEP * _TILE_STEP)
    fits = held_bytes(shrunk, batch_tokens, weight_shape, itemsize, tile_bytes_per_token) <= bound
    return shrunk if fits else tile


def _as_float32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    bits = (hi.to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def _store(hi: torch.Tensor, lo: torch.Tensor, value: torch.Tensor) -> None:
    bits = value.view(torch.int32)
    hi.copy_((bits >> 16).to(torch.int16))
    lo.copy_(bits.to(torch.int16))  # the low 16 bits (int32 -> int16 keeps them)


#: ``0xFFFF0000`` as an int32: the upper half of a 32-bit word
_UPPER = -65536


def add_words_(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`split_add_` on planes viewed as int32 words (see :func:`as_words`).

    Compilers for the CPU vectorize 32-bit integer and float lanes but not 16-bit integer
    ones (Inductor's C++ backend emits a scalar loop for int16), so the planes are read and
    written as words holding elements ``2k`` (lower half, little-endian) and ``2k + 1``
    (upper half); every bit lands where :func:`_store` puts it. A bfloat16 ``x``, also in
    words, is widened by shifting its bits (what the conversion to float32 does), so the
    add is one vectorized pass that moves the float32 schedule's bytes.
    """
    if x.dtype == torch.int32:  # bfloat16 pairs
        x_even, x_odd = (x << 16).view(torch.float32), (x & _UPPER).view(torch.float32)
    else:
        wide = x.to(torch.float32)
        x_even, x_odd = wide[..., 0::2], wide[..., 1::2]
    even = ((hi << 16) | (lo & 0xFFFF)).view(torch.float32) + x_even
    odd = ((hi & _UPPER) | ((lo >> 16) & 0xFFFF)).view(torch.float32) + x_odd
    even_bits, odd_bits = even.view(torch.int32), odd.view(torch.int32)
    hi.copy_(((even_bits >> 16) & 0xFFFF) | (odd_bits & _UPPER))
    lo.copy_((even_bits & 0xFFFF) | (odd_bits << 16))


def as_words(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    """``(hi, lo, x)`` as :func:`add_words_` takes them, or ``None`` where the rows cannot be
    paired (an odd or strided last dimension). The views are taken outside any compiled
    kernel: a reinterpretation to a wider dtype inside one costs a copy."""
    pairable = (
        hi.dim() > 0
        and hi.shape[-1] % 2 == 0
        and hi.is_contiguous()
        and lo.is_contiguous()
        and x.shape == hi.shape
        and (x.dtype != torch.bfloat16 or x.is_contiguous())
    )
    if not pairable:
        return None
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int32)
    return hi.view(torch.int32), lo.view(torch.int32), x


def split_add_(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """``sum += x`` in float32 on the two planes of ``sum``, in place (any shape)."""
    words = as_words(hi, lo, x)
    if words is not None:
        add_words_(*words)
    else:
        _store(hi, lo, _as_float32(hi, lo) + x.to(torch.float32))


def _blocks(rows: int, row_bytes: int):
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


@torch.library.custom_op("tile_pass::split_accumulate_", mutates_args=("hi", "lo"))
def split_accumulate_(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """``sum += x`` on the planes ``(hi, lo)`` of a float32 sum, in row blocks."""
    _zero_if_unwritten(hi, lo)
    for start, stop in _blocks(hi.shape[0], hi[0].numel() * 12 if hi.dim() else 12):
        split_add_(hi[start:stop], lo[start:stop], x[start:stop])


@split_accumulate_.register_fake
def _(hi, lo, x):
    return None


def split_accumulate_mm_(
    hi: torch.Tensor,
    lo: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    add=None,
    store=None,
    add_and_round=None,
) -> None:
    """``sum += a @ b``, the product formed one block of rows at a time in the model dtype (as
    the derived graph forms it), so no ``[V, H]`` temporary exists. ``add(hi, lo, block)`` is
    the per-block add (a compiled :func:`split_add_` in compiled tiles); ``store(hi, lo,
    block)``, where given, writes the first contribution into planes no add has written yet
    (see :func:`unwritten_planes`), which are otherwise zeroed first; ``add_and_round``, where
    given, is the add used inside :func:`last_add`, which also rounds the sum over ``hi``."""
    if _key(hi) in _marked("rounded"):  # an add after the last: the planes hold the result now
        raise RuntimeError(
            "tile_pass: a split weight-gradient sum was added into after its last add rounded it"
        )
    add = add or split_add_
    if store is not None and _claim(hi):
        add = store
    else:
        _zero_if_unwritten(hi, lo)
        if add_and_round is not None and _claim_rounding(hi):
            add = add_and_round
    step = product_block_rows(hi.shape[0], b.shape[1] * max(a.element_size(), 1))
    blocks = [(start, min(start + step, hi.shape[0])) for start in range(0, hi.shape[0], step)]
    if not blocks:
        return
    # one block buffer for every block: a fresh one per block would fault its pages in again
    product = a.new_empty((blocks[0][1] - blocks[0][0], b.shape[1]), dtype=torch.result_type(a, b))
    for start, stop in blocks:
        block = product[: stop - start]
        add(hi[start:stop], lo[start:stop], torch.mm(a[start:stop], b, out=block))


_local = threading.local()


def _marked(name: str) -> set:
    """This thread's planes (by their high plane's address and size) in the state ``name``:
    ``unwritten`` (no add has written them), ``last`` (inside :func:`last_add`), ``rounded``
    (an add rounded them)."""
    return vars(_local).setdefault(name, set())  # the thread-local object's dict is this thread's


def _key(hi: torch.Tensor) -> tuple[int, int]:
    return hi.data_ptr(), hi.numel()


def _take(name: str, hi: torch.Tensor) -> bool:
    """Whether ``hi``'s planes were in the state ``name``; they no longer are."""
    planes, key = _marked(name), _key(hi)
    found = key in planes
    planes.discard(key)
    return found


def _claim(hi: torch.Tensor) -> bool:
    """Whether ``hi`` is the high plane of :func:`unwritten_planes` no add has written yet;
    from now on it counts as written."""
    return _take("unwritten", hi)


@contextlib.contextmanager
def last_add(hi: torch.Tensor) -> Iterator[None]:
    """Run the tile loop's last tile: its blocked add into these planes (where it has an
    ``add_and_round``) also rounds the sum into the weight dtype over ``hi``, which saves
    :func:`tile_pass.tiles._tile_kernel.finish_split` a pass over both planes (see
    :func:`rounded_by_last_add`). The same numbers: the split is lossless."""
    _marked("last").add(_key(hi))
    try:
        yield
    finally:
        _marked("last").discard(_key(hi))


def _claim_rounding(hi: torch.Tensor) -> bool:
    if _take("last", hi):
        _marked("rounded").add(_key(hi))
        return True
    return False


def rounded_by_last_add(hi: torch.Tensor) -> bool:
    """Whether the add inside :func:`last_add` rounded these planes (``hi`` holds the result)."""
    return _take("rounded", hi)


def unwritten_planes(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes of a float32 sum of zeros for one tile loop, not yet zeroed: the first add
    into them stores its contribution (a C loop on the CPU) or zeroes them first, which saves
    a pass over both planes. Call :func:`settle` after the loop: it zeroes them if nothing was
    added. A marker left by a loop that raised is harmless: it is claimed by the first add
    into whatever planes next occupy that memory, and the first add into a sum of zeros is a
    store."""
    hi = _tile_buffers.empty(shape, torch.int16, device)
    lo = _tile_buffers.empty(shape, torch.int16, device)
    _marked("rounded").discard(_key(hi))  # left by a loop that raised before its finish
    _marked("unwritten").add(_key(hi))
    return hi, lo


def _zero_if_unwritten(hi: torch.Tensor, lo: torch.Tensor) -> None:
    if _claim(hi):
        hi.zero_()
        lo.zero_()


def settle(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes of :func:`unwritten_planes` after the loop: zeros if no add wrote them."""
    _zero_if_unwritten(hi, lo)
    return hi, lo


def zeros(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 sum of zeros, as its two planes."""
    return tuple(_tile_buffers.zeros(shape, torch.int16, device) for _ in range(2))


def _bfloat16_bits(bits: torch.Tensor) -> torch.Tensor:
    """The bfloat16 nearest (ties to even) to the float32 with these bits, as its 16 bits in the
    low half of an int32; NaN stays NaN. This is c10's conversion, spelled in integer lanes:
    a compiler keeps a bfloat16 intermediate in float32 and would skip a ``.to(bfloat16)``."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(nan, 0x7FC0, rounded)


def round_words_(hi: torch.Tensor, lo: torch.Tensor) -> None:
    """:func:`finish` for bfloat16 on the planes' int32 words (see :func:`add_words_`): one pass
    with no temporaries when compiled; each word's two rounded values go over ``hi``."""
    even = _bfloat16_bits((hi << 16) | (lo & 0xFFFF))
    odd = _bfloat16_bits((hi & _UPPER) | ((lo >> 16) & 0xFFFF))
    hi.copy_(even | (odd << 16))


def finish(hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 sum rounded once into ``dtype`` (16 bits), written over ``hi`` in place;
    ``lo`` is dead afterwards. Each element is read from its own pair and written to its own
    place, so the blocks can be converted in any order."""
    if dtype.itemsize != 2:
        raise ValueError(f"the split sum rounds into a 16-bit dtype, not {dtype}")
    for start, stop in _blocks(hi.shape[0], hi[0].numel() * 8 if hi.dim() else 8):
        block = _as_float32(hi[start:stop], lo[start:stop]).to(dtype)
        hi[start:stop].copy_(block.view(torch.int16))
    return hi.view(dtype)
