"""The per-tile function's key, its named inputs and its tracing, once per key.

One tile of a region is its row-wise program (:mod:`tile_pass.tiles.tiled_region` builds the joint
function: the program's outputs and ``torch.autograd.grad`` of ``sum(tangent * output)``).
Its gradient is never written by hand: :func:`trace_fake` traces it with ``make_fx`` into an
aten graph, exactly as AOTAutograd derives a joint graph; the post-trace passes
(:mod:`tile_pass.tiles._tile_passes`) rewrite that graph, and :func:`traced_once` caches the result
per :class:`TileKernelKey`. The tracer and the tile loop name the tile's inputs alike
(:class:`TileInputs`): shapes and dtypes for the one, the tile's tensors for the other.

The graph is traced on the tracing thread, under Dynamo's compile lock, which is what makes it
usable inside a custom op at run time (:mod:`tile_pass._caches` says why).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass._caches import BoundedCache, on_tracing_thread, tracing_lock
from tile_pass.plan._weight_grad import WeightGradSchedule

#: the shape and dtype of a per-token input, without its token dimension
RowPart = tuple[tuple[int, ...], torch.dtype]


@dataclasses.dataclass(frozen=True)
class TileKernelKey:
    """A traced tile function of one program, for one tile size, dtype and device."""

    program: str
    tile: int
    hidden_size: int
    vocab_size: int  # the program's (this rank's rows when sharded)
    hidden_dtype: torch.dtype
    weight_dtype: torch.dtype
    bias_dtype: torch.dtype | None
    token_inputs: tuple[RowPart, ...]  # per-token row part and dtype
    row_inputs: tuple[RowPart, ...]  # whole shape and dtype
    tangents: tuple[int, ...]  # the outputs that get a tangent (a token weight)
    device: torch.device
    need_hidden: bool
    need_weight: bool
    need_bias: bool
    acc_dtype: torch.dtype
    compiled: bool = False
    onednn: bool = False
    weight_grad: WeightGradSchedule = WeightGradSchedule.FLOAT32
    #: per row input / per-token input: differentiated too (a learnable logit scale, a [V] offset,
    #: class weights, class-probability targets); row gradients are summed over the tiles
    need_rows: tuple[bool, ...] = ()
    need_tokens: tuple[bool, ...] = ()
    #: a tile of whole coupled groups (tile_pass.tiles._coupled_tiles), which evaluates its
    #: tangents itself, at its tokens' positions
    coupled: bool = False


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype the tracer makes a fake input of (a pytree leaf, as a tensor is)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


Input = torch.Tensor | TensorSpec


class TileInputs(NamedTuple):
    """What a tile function takes, by name: :class:`TensorSpec` for the tracer, tensors for
    the tile loop. The traced graph takes :meth:`flat`: the fields in order, ``None`` left out."""

    hidden: Input
    weight: Input
    bias: Input | None
    token_inputs: tuple[Input, ...]
    row_inputs: tuple[Input, ...]
    tangents: tuple[Input, ...]  # one per ``TileKernelKey.tangents``
    weight_grad_sum: tuple[Input, ...]  # FLOAT32: the sum; SPLIT: its two planes; DIRECT: none
    bias_grad_sum: Input | None
    row_grad_sums: tuple[Input, ...] = ()  # one per differentiated row input, in the accumulation dtype
    coupled: tuple[Input, ...] = ()  # a coupled tile's token positions

    def flat(self) -> list[Input]:
        # pytree.tree_leaves order, written out: this runs once per tile
        flat = [self.hidden, self.weight]
        if self.bias is not None:
            flat.append(self.bias)
        flat += self.token_inputs
        flat += self.row_inputs
        flat += self.tangents
        flat += self.weight_grad_sum
        if self.bias_grad_sum is not None:
            flat.append(self.bias_grad_sum)
        flat += self.row_grad_sums
        flat += self.coupled
        return flat


def differentiable(tensors, needs) -> tuple[list, list[torch.Tensor]]:
    """``tensors`` with each one ``needs`` marks replaced by a fresh leaf that requires grad, and
    those leaves in order: what a tile function differentiates (call it under ``enable_grad``)."""
    leaves = [t.detach().requires_grad_() if need else t for t, need in zip(tensors, needs, strict=True)]
    return leaves, [t for t, need in zip(leaves, needs, strict=True) if need]


def trace_fake(fn, inputs, device: torch.device) -> torch.fx.GraphModule:
    """``fn(inputs)`` traced by ``make_fx`` on zero-filled fake tensors of the shapes and dtypes
    of ``inputs`` (a pytree of :class:`TensorSpec` and ``None``, such as a :class:`TileInputs`);
    the graph takes the specs' tensors in pytree order, the ``None`` left out."""
    specs, structure = pytree.tree_flatten(inputs)
    with FakeTensorMode(allow_non_fake_inputs=False):
        examples = [torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs if s is not None]

    def flat_fn(*args):
        given = iter(args)
        return fn(pytree.tree_unflatten([None if s is None else next(given) for s in specs], structure))

    return make_fx(flat_fn, tracing_mode="fake")(*examples)


#: Traced tile functions kept at once. A tile function is specialised to one tile size (a
#: bounded set of sizes per region, see _tiling.padded_rows), dtype and region; 128 covers
#: dozens of regions.
TILE_KERNEL_CACHE_SIZE = 128
_cache = BoundedCache("tile functions", TILE_KERNEL_CACHE_SIZE)
#: :func:`inductor_once`'s kernels by name and layout.
_compiled_adds = BoundedCache("compiled plane kernels", 64)


def traced_once(key, trace):
    """``trace(key)``, run once per process on the tracing thread (see
    :mod:`tile_pass._caches`) and kept in the bounded cache of tile functions."""
    kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with tracing_lock():
        kernel = _cache.get(key)
        if kernel is None:
            kernel = _cache.put(key, on_tracing_thread(lambda: trace(key)))
    return kernel


def inductor_once(name: str, fn, examples) -> object:
    """``fn`` (in-place updates of its arguments) traced and compiled by Inductor, once per
    ``name`` and layout of ``examples`` (kept in a bounded cache). Tracing runs ``fn``, so it
    runs on scratch tensors of the examples' layouts, never on the examples themselves."""
    layout = (name,) + tuple((t.shape, t.stride(), t.dtype, t.device) for t in examples)
    compiled = _compiled_adds.get(layout)
    if compiled is None:
        from torch._inductor.compile_fx import compile_fx

        with tracing_lock():
            compiled = _compiled_adds.get(layout)
            if compiled is None:
                scratch = [
                    torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in examples
                ]
                traced = make_fx(fn)(*scratch)
                with torch.no_grad():
                    compiled = _compiled_adds.put(layout, compile_fx(traced, scratch))
    return compiled
