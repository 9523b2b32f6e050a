"""The per-tile function's key, its named inputs and its tracing, once per key.

One tile of a region is its row-wise program (:mod:`tile_pass.tiles.tiled_region` builds the joint
function: the program's outputs and ``torch.autograd.grad`` of ``sum(tangent * output)``).
Its gradient is never written by hand: :func:`trace_fake` traces it with ``make_fx`` into an
aten graph, exactly as AOTAutograd derives a joint graph; the post-trace passes
(:mod:`tile_pass.tiles._tile_passes`) rewrite that graph, and :func:`traced_once` caches the result
per :class:`TileKernelKey`. The tracer and the tile loop name the tile's inputs alike
(:class:`TileInputs`): shapes and dtypes for the one, the tile's tensors for the other.

Two details make that graph usable inside a custom op at run time:

* Tracing happens on a helper thread. A custom op's implementation runs below the
  autograd dispatch keys, so autograd records nothing there; a fresh thread has the
  default dispatch state, and tracing only touches fake tensors.
* Tracing holds Dynamo's compile lock. FX tracing keeps process-global state (the
  "is tracing" flag and the active patcher); a tile traced at run time in one thread while
  another thread compiles would interleave that state and leave the flag set, after which
  every later compile in the process fails with "symbolically trace a dynamo-optimized
  function". The lock is taken before the cache lock, in the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program._operands import RegionOperands

#: the shape and dtype of an operand, without its token dimension where it has one
RowPart = tuple[tuple[int, ...], torch.dtype]


@dataclasses.dataclass(frozen=True)
class TileKernelKey:
    """A traced tile function of one program, for one tile size, dtype and device."""

    program: str
    tile: int
    vocab_size: int  # the program's (this rank's rows when sharded)
    #: the tile's operands by group: per-token ones (``hidden``, ``tokens``) by their row part
    #: (the shape after the token dimension) and dtype, the others whole; no ``reduce`` group
    operands: RegionOperands[RowPart]
    tangents: tuple[int, ...]  # the outputs that get a tangent (a token weight)
    device: torch.device
    #: which operands the tile differentiates (a learnable logit scale, a [V] offset, class
    #: weights, class-probability targets too); a shared input's gradient is summed over the tiles
    need: RegionOperands[bool]
    acc_dtype: torch.dtype
    compiled: bool = False
    onednn: bool = False
    weight_grad: WeightGradSchedule = WeightGradSchedule.FLOAT32
    #: a tile of whole coupled groups (tile_pass.tiles._coupled_tiles), which evaluates its
    #: tangents itself, at its tokens' positions
    coupled: bool = False

    @property
    def hidden_size(self) -> int:
        return self.operands.hidden[0][0]

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.operands.hidden[1]

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.operands.weight[1]

    @property
    def bias_dtype(self) -> torch.dtype | None:
        return None if self.operands.bias is None else self.operands.bias[1]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype the tracer makes a fake input of (a pytree leaf, as a tensor is)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


Input = torch.Tensor | TensorSpec


class TileInputs(NamedTuple):
    """What a tile function takes, by name: :class:`TensorSpec` for the tracer, tensors for
    the tile loop. The traced graph takes :meth:`flat`: the fields in order, ``None`` left out."""

    operands: RegionOperands[Input]  # hidden and per-token inputs at the tile's rows; no reduce group
    tangents: tuple[Input, ...]  # one per ``TileKernelKey.tangents``
    weight_grad_sum: tuple[Input, ...]  # FLOAT32: the sum; SPLIT: its two planes; DIRECT: none
    bias_grad_sum: Input | None
    whole_grad_sums: tuple[Input, ...] = ()  # per differentiated operand of a whole group, accumulation dtype
    coupled: tuple[Input, ...] = ()  # a coupled tile's token positions

    def flat(self) -> list[Input]:
        # pytree.tree_leaves order, written out: this runs once per tile
        flat = [t for t in self.operands.flat() if t is not None]
        flat += self.tangents
        flat += self.weight_grad_sum
        if self.bias_grad_sum is not None:
            flat.append(self.bias_grad_sum)
        flat += self.whole_grad_sums
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


#: Set on the tracing thread, whose caller already holds the compile lock for it.
_tracer_state = threading.local()


def _tracing_lock():
    """Dynamo's compile lock (an ``RLock``): no FX tracing of ours overlaps a compile or
    another trace in any thread (see the module docstring)."""
    if getattr(_tracer_state, "caller_holds_lock", False):
        return contextlib.nullcontext()
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


_every_cache: weakref.WeakSet = weakref.WeakSet()


class _BoundedCache:
    """A least-recently-used map with at most ``limit`` entries: a long run that meets many
    shapes (or a notebook that recompiles) keeps only the kernels it still uses."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: OrderedDict = OrderedDict()
        _every_cache.add(self)  # emptied by clear_caches

    def get(self, key):
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key, value):
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        return value

    def __iter__(self):
        return iter(list(self._entries))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


#: Traced tile functions kept at once. A tile function is specialised to one tile size (a
#: bounded set of sizes per region, see _tiling.padded_rows), dtype and region; 128 covers
#: dozens of regions.
TILE_KERNEL_CACHE_SIZE = 128
_cache = _BoundedCache(TILE_KERNEL_CACHE_SIZE)
#: :func:`inductor_once`'s kernels by name and layout.
_compiled_adds = _BoundedCache(64)
_cache_lock = threading.Lock()
#: the tracing thread (started by the first trace: an executor starts its threads on submit)
_tracer = concurrent.futures.ThreadPoolExecutor(1, "tile_pass_tracer")


def traced_once(key, trace):
    """``trace(key)``, run once per process on the tracing thread (see the module docstring)
    and kept in the bounded cache of tile functions."""
    with _cache_lock:
        kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _tracing_lock(), _cache_lock:
        kernel = _cache.get(key)
        if kernel is None:
            kernel = _cache.put(key, _tracer.submit(_on_tracing_thread, trace, key).result())
    return kernel


def _on_tracing_thread(trace, key):
    _tracer_state.caller_holds_lock = True
    return trace(key)


def on_tracing_thread(trace):
    """``trace()`` on the tracing thread, under the compile lock, uncached: for traces that are
    not tile functions (tile_pass.program._token_weights)."""
    with _tracing_lock():
        return _tracer.submit(_on_tracing_thread, lambda _: trace(), None).result()


def inductor_once(name: str, fn, examples) -> object:
    """``fn`` (in-place updates of its arguments) traced and compiled by Inductor, once per
    ``name`` and layout of ``examples`` (kept in a bounded cache). Tracing runs ``fn``, so it
    runs on scratch tensors of the examples' layouts, never on the examples themselves."""
    layout = (name,) + tuple((t.shape, t.stride(), t.dtype, t.device) for t in examples)
    compiled = _compiled_adds.get(layout)
    if compiled is None:
        from torch._inductor.compile_fx import compile_fx

        with _tracing_lock():
            compiled = _compiled_adds.get(layout)
            if compiled is None:
                scratch = [
                    torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in examples
                ]
                traced = make_fx(fn)(*scratch)
                with torch.no_grad():
                    compiled = _compiled_adds.put(layout, compile_fx(traced, scratch))
    return compiled


def clear_caches() -> None:
    """Drop every traced tile function, compiled accumulation kernel and derived token-weight
    graph (they are rebuilt on next use); ``torch._dynamo.reset()`` does not reach them."""
    with _cache_lock:
        for cache in list(_every_cache):
            cache.clear()
