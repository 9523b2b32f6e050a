"""The split sum's passes over its planes on the CPU, as C loops built by Inductor's C++ toolchain.

Every tile of a half-precision head reads and writes both 16-bit planes of the float32
weight-gradient sum once (:mod:`tile_pass.tiles._split_planes`), so that pass is the part of the
step that grows with the number of tiles. Written as tensor code and compiled by Inductor
(:func:`tile_pass.tiles._split_planes.add_words_`), it runs at about a third of the memory
bandwidth: Inductor's C++ backend has no vectorized 16-bit integer lanes, and spells each
int32/float32 reinterpretation of the word-paired form as a store and reload through a stack
array. The same loop written once in C, on the 16-bit planes directly, is vectorized by the
compiler and runs at memory speed: 36 ms instead of 94 ms for one pass over a 128256 x 1024
plane pair on a 2-core Xeon (AVX-512), where a tile's three GEMMs take about 330 ms.

Four loops, each the eager definition element by element (``tests/test_weight_grad.py``
checks them bit for bit, special values included):

* ``add``: the float32 value the planes hold (``hi << 16 | lo``), plus the contribution
  widened to float32, split again. One IEEE float32 add per element, as
  :func:`tile_pass.tiles._split_planes.split_add_`.
* ``store``: the first tile's contribution into planes nobody zeroed (``0 + x``), which saves
  the zeroing pass over both planes.
* ``finish``: the sum rounded once into the returned dtype, over ``hi``.
* ``add_and_round``: the last tile's ``add`` and ``finish`` in one pass (the split is lossless,
  so rounding the new sum directly is the same number): it saves the finish pass over both
  planes and the last tile's write of ``lo`` (40 ms of a 128256 x 1024 head).

Nothing here is a gradient formula.

The loops are built by ``CppPythonBindingsCodeCache``, the loader of Inductor's own CPU
kernels (same compiler, flags and on-disk cache). Where it cannot build them, ``add`` returns
``None`` and the caller keeps the Inductor-compiled tensor code.
"""

from __future__ import annotations

import functools

import torch

from tile_pass._logging import log

_PRELUDE = r"""
// Inductor builds its kernels with -fno-tree-loop-vectorize (they vectorize by hand); this loop
// is left to the compiler's vectorizer, which doubles its speed.
#pragma GCC optimize("tree-loop-vectorize")
#include <cstdint>
#include <cstring>
static inline float as_float(uint32_t bits) { float value; std::memcpy(&value, &bits, 4); return value; }
static inline uint32_t as_bits(float value) { uint32_t bits; std::memcpy(&bits, &value, 4); return bits; }
"""

#: How each dtype of the contribution is widened to float32 (exactly: every 16-bit value is a float32).
_WIDEN = {
    torch.bfloat16: ("uint16_t", "as_float(uint32_t(x[i]) << 16)"),
    torch.float16: ("_Float16", "float(x[i])"),
    torch.float32: ("float", "x[i]"),
}

_ADD = r"""
extern "C" void kernel(uint16_t* hi, uint16_t* lo, const {x_type}* x, int64_t n) {{
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) {{
        uint32_t sum = as_bits(as_float((uint32_t(hi[i]) << 16) | lo[i]) + {widen});
        hi[i] = uint16_t(sum >> 16);
        lo[i] = uint16_t(sum);
    }}
}}
"""

#: The first contribution stored as the sum (``0 + x``, bit for bit: a negative zero becomes
#: ``+0``), so the planes need no zeroing pass before the first tile.
_STORE = r"""
extern "C" void kernel(uint16_t* hi, uint16_t* lo, const {x_type}* x, int64_t n) {{
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) {{
        uint32_t sum = as_bits({widen});
        sum = sum == 0x80000000u ? 0u : sum;
        hi[i] = uint16_t(sum >> 16);
        lo[i] = uint16_t(sum);
    }}
}}
"""

#: The float32 sum rounded once into the returned dtype, over ``hi``. bfloat16 is c10's
#: conversion (ties to even, NaN to the canonical quiet NaN) in integer arithmetic; float16 is
#: the compiler's conversion, the same IEEE rounding as the vectorized eager ``.to()``.
_ROUND = {
    torch.bfloat16: r"""
static inline uint16_t round_sum(uint32_t bits) {
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
""",
    torch.float16: r"""
static inline uint16_t round_sum(uint32_t bits) {
    _Float16 half = static_cast<_Float16>(as_float(bits));
    uint16_t out; std::memcpy(&out, &half, 2); return out;
}
""",
}

_FINISH = r"""
extern "C" void kernel(uint16_t* hi, const uint16_t* lo, int64_t n) {
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) hi[i] = round_sum((uint32_t(hi[i]) << 16) | lo[i]);
}
"""


#: The last contribution added and the sum rounded at once, over ``hi`` (``lo`` is dead after it).
_ADD_AND_ROUND = r"""
extern "C" void kernel(uint16_t* hi, const uint16_t* lo, const {x_type}* x, int64_t n) {{
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i)
        hi[i] = round_sum(as_bits(as_float((uint32_t(hi[i]) << 16) | lo[i]) + {widen}));
}}
"""


def _build(argtypes: list[str], source: str, what: str):
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(argtypes, _PRELUDE + source)
    except Exception as error:  # no compiler, or an Inductor without this loader
        log.info("split-sum C loop (%s) not built (%s); using Inductor's kernel", what, error)
        return None


#: the loops over the planes and a contribution, by name
_PLANE_LOOPS = {"add": _ADD, "store": _STORE}


@functools.cache
def _contribution_kernel(loop: str, dtype: torch.dtype):
    x_type, widen = _WIDEN[dtype]
    return _build(
        ["uint16_t*", "uint16_t*", f"const {x_type}*", "int64_t"],
        _PLANE_LOOPS[loop].format(x_type=x_type, widen=widen),
        f"{loop} {dtype}",
    )


@functools.cache
def _add_and_round_kernel(dtype: torch.dtype, rounded: torch.dtype):
    x_type, widen = _WIDEN[dtype]
    return _build(
        ["uint16_t*", "const uint16_t*", f"const {x_type}*", "int64_t"],
        _ROUND[rounded] + _ADD_AND_ROUND.format(x_type=x_type, widen=widen),
        f"add {dtype} and round to {rounded}",
    )


@functools.cache
def _finish_kernel(dtype: torch.dtype):
    return _build(["uint16_t*", "const uint16_t*", "int64_t"], _ROUND[dtype] + _FINISH, f"round to {dtype}")


def _planes_fit(hi: torch.Tensor, lo: torch.Tensor) -> bool:
    return (
        hi.device.type == "cpu"
        and hi.dtype == lo.dtype == torch.int16
        and hi.shape == lo.shape
        and hi.is_contiguous()
        and lo.is_contiguous()
    )


def _planes_and_contribution_fit(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> bool:
    return _planes_fit(hi, lo) and x.dtype in _WIDEN and x.shape == hi.shape and x.is_contiguous()


def add(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    """A function ``(hi, lo, x) -> None`` doing ``sum += x`` on the planes in place, for blocks of
    this layout, or ``None`` where the C loop does not apply or cannot be built."""
    return _loop("add", hi, lo, x)


def store(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    """A function ``(hi, lo, x) -> None`` doing ``sum = 0 + x`` on unwritten planes, for blocks
    of this layout, or ``None`` where the C loop does not apply or cannot be built."""
    return _loop("store", hi, lo, x)


def add_and_round(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, rounded: torch.dtype):
    """A function ``(hi, lo, x) -> None`` doing ``sum += x`` and writing the sum rounded into
    ``rounded`` over ``hi`` (as its 16 bits), for blocks of this layout, or ``None`` where the C
    loop does not apply or cannot be built."""
    if rounded not in _ROUND or not _planes_and_contribution_fit(hi, lo, x):
        return None
    return _checked(_add_and_round_kernel(x.dtype, rounded), x.dtype)


def _loop(loop: str, hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    if not _planes_and_contribution_fit(hi, lo, x):
        return None
    return _checked(_contribution_kernel(loop, x.dtype), x.dtype)


def _checked(kernel, dtype: torch.dtype):
    """``kernel`` called on the planes and a contribution of ``dtype``, their layout checked."""
    if kernel is None:
        return None

    def run(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
        if x.dtype != dtype or not _planes_and_contribution_fit(hi, lo, x):
            raise ValueError(
                f"this split-sum C loop takes contiguous int16 planes and a same-shape {dtype} contribution"
            )
        kernel(hi, lo, x, hi.numel())

    return run


def finish(hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The sum rounded once into ``dtype`` over ``hi`` (returned as a ``dtype`` view), or ``None``
    where the C loop does not apply or cannot be built."""
    if dtype not in _ROUND or not _planes_fit(hi, lo):
        return None
    kernel = _finish_kernel(dtype)
    if kernel is None:
        return None
    kernel(hi, lo, hi.numel())
    return hi.view(dtype)
