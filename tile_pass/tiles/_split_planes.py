"""The split weight-gradient sum at run time: a float32 sum across tiles held in two 16-bit planes.

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
import threading
from collections.abc import Iterator

import torch

from tile_pass.plan import _weight_grad
from tile_pass.tiles import _tile_buffers


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
    step = max(1, _weight_grad.BLOCK_BYTES // max(1, row_bytes))
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
    step = _weight_grad.product_block_rows(hi.shape[0], b.shape[1] * max(a.element_size(), 1))
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
    :func:`tile_pass.tiles._tile_passes.split_accumulation.finish_split` a pass over both planes (see
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
