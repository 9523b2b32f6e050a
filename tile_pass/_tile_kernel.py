"""The per-tile function's passes and its tracing, once per key.

One tile of a region is its row-wise program (:mod:`tile_pass.tiled_region` builds the joint
function: the program's outputs and ``torch.autograd.grad`` of ``sum(tangent * output)``).
Its gradient is never written by hand: :func:`trace_fake` traces it with ``make_fx`` into an
aten graph, exactly as AOTAutograd derives a joint graph; :func:`finish_tile_graph` applies
the post-trace passes in order, and :func:`traced_once` caches the result per key.

Three details make that graph usable inside a custom op at run time:

* Tracing happens on a helper thread. A custom op's implementation runs below the
  autograd dispatch keys, so autograd records nothing there; a fresh thread has the
  default dispatch state, and tracing only touches fake tensors.
* Tracing holds Dynamo's compile lock. FX tracing keeps process-global state (the
  "is tracing" flag and the active patcher); a tile traced at run time in one thread while
  another thread compiles would interleave that state and leave the flag set, after which
  every later compile in the process fails with "symbolically trace a dynamo-optimized
  function". The lock is taken before the cache lock, in the caller's thread.
* The weight gradient is accumulated in place. The derived graph ends in
  ``acc.add_(t(t(mm(a, b))))``; :func:`_accumulate_weight_grad_in_place` rewrites that
  into ``acc.addmm_(a, b)`` when the dtypes allow, so no ``[V, H]`` temporary is made
  per tile. The rewrite changes where the sum lands, not what is summed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import threading
import weakref
from collections import OrderedDict

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from tile_pass import _settings, _split_sum_cpu, _tile_buffers, _weight_grad
from tile_pass._logging import log
from tile_pass._simplify import simplify, split_label_column
from tile_pass._tiling import STORE_GRAD_OVER_LOGITS

aten = torch.ops.aten


def differentiable(tensors, needs) -> tuple[list, list[torch.Tensor]]:
    """``tensors`` with each one ``needs`` marks replaced by a fresh leaf that requires grad, and
    those leaves in order: what a tile function differentiates (call it under ``enable_grad``)."""
    leaves = [t.detach().requires_grad_() if need else t for t, need in zip(tensors, needs, strict=True)]
    return leaves, [t for t, need in zip(leaves, needs, strict=True) if need]


def _strip_transpose_pairs(node: torch.fx.Node) -> torch.fx.Node:
    while (
        node.target is aten.t.default
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target is aten.t.default
    ):
        node = node.args[0].args[0]
    return node


def _accumulate_weight_grad_in_place(gm: torch.fx.GraphModule) -> int:
    """Turn ``acc.add_(mm(a, b))`` (modulo double transposes) into ``acc.addmm_(a, b)``."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.add_.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        acc, update = node.args
        source = _strip_transpose_pairs(update)
        if source.target is not aten.mm.default:
            continue
        a, b = source.args
        acc_val, a_val, b_val = acc.meta.get("val"), a.meta.get("val"), b.meta.get("val")
        if acc_val is None or a_val is None or b_val is None:
            continue
        if not (acc_val.dtype == a_val.dtype == b_val.dtype):
            continue  # a half-precision tile gradient is added (upcast) into the fp32 sum
        with gm.graph.inserting_before(node):
            addmm = gm.graph.call_function(aten.addmm_.default, (acc, a, b))
        addmm.meta = dict(node.meta)
        node.replace_all_uses_with(addmm)
        gm.graph.erase_node(node)
        fused += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return fused


_GEMMS = {
    aten.mm.default,
    aten.addmm.default,
    aten.addmm_.default,
    *_tile_buffers.REPLACES.values(),
    _tile_buffers.fresh_mm,
}
_VIEWS = {aten.t.default, aten.detach.default, aten.view.default, aten.transpose.int, aten.permute.default}


def _split_at_gemms(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """Split the derived tile graph into GEMMs and the elementwise middle between them.

    ``submod_1`` of the result takes the logits tile and returns the losses and the logits
    gradient (everything that depends on the logits but on no backward GEMM); Inductor
    fuses it into a few passes over the tile, while the GEMMs, including the in-place
    weight-gradient ``addmm_``, stay library calls. ``None`` if the graph has no such shape.
    """
    nodes = list(gm.graph.nodes)
    logits = next((n for n in nodes if n.target in _GEMMS), None)
    if logits is None:
        return None
    on_logits, after_gemm = set(), set()
    for n in nodes:
        if n is logits or any(a in on_logits for a in n.all_input_nodes):
            on_logits.add(n)
        if n in on_logits and n is not logits and n.target in _GEMMS:
            after_gemm.add(n)
        elif any(a in after_gemm for a in n.all_input_nodes):
            after_gemm.add(n)

    def feeds_gemm_only(n):  # views whose every use is a backward GEMM
        return (
            n.target in _VIEWS
            and n.users
            and all((u in after_gemm and u.target in _GEMMS) or feeds_gemm_only(u) for u in n.users)
        )

    partition = {}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n in on_logits and n is not logits and n not in after_gemm and not feeds_gemm_only(n):
            partition[n] = 1
        elif n in after_gemm or (n in on_logits and n is not logits):
            partition[n] = 2
        else:
            partition[n] = 0
    if 1 not in partition.values():
        return None
    # what only the middle reads joins it (a gather's gradient: zeros of the tile's shape with
    # the token weights scattered in), so Inductor fuses it instead of the tile realising it
    for n in reversed(nodes):
        users = [u for u in n.users if u.op != "output"]
        if (
            partition.get(n) == 0
            and n is not logits
            and n.target not in _GEMMS
            and users
            and len(users) == len(n.users)
        ):
            if all(partition.get(u) == 1 for u in users):
                partition[n] = 1
    return split_module(gm, None, lambda n: partition[n])


class _Compiled(torch.nn.Module):
    """Holds an Inductor-compiled function where the split graph expects a submodule.

    With ``overwritten=(i, j)`` the compiled function stores its ``j``-th output over its
    ``i``-th input instead of returning it; the wrapper puts that input back at position
    ``j`` (``j=None``: it was the only output) so the callers see the original outputs.
    """

    def __init__(self, fn, overwritten: tuple[int, int | None] | None = None):
        super().__init__()
        self.fn = fn
        self.overwritten = overwritten

    def forward(self, *args):
        return self.restore(args, self.fn(*args))

    def restore(self, args, outputs):
        """The middle's original outputs from the compiled function's."""
        if self.overwritten is None:
            return outputs
        arg, position = self.overwritten
        if position is None:  # the overwritten input was the only output
            return args[arg]
        outputs = list(outputs)
        outputs.insert(position, args[arg])
        return tuple(outputs)


def _aliases_of(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every view taken of it (transitively)."""
    found, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user.target in _VIEWS and user not in found:
                found.add(user)
                todo.append(user)
    return found


def _store_grad_over_logits(
    split: torch.fx.GraphModule, logits_name: str
) -> tuple[torch.fx.GraphModule, tuple[int, int | None]] | None:
    """The middle rewritten to write the logits gradient over the logits tile it read.

    The logits tile is dead once the middle has read it, and the gradient has its shape,
    dtype and layout, so one ``[tile, V]`` buffer serves both: the tile keeps one buffer
    alive instead of two (four for a half-precision head), and the fused kernel writes to
    memory that is already mapped. Inductor lowers the trailing ``copy_`` into a store of
    the fused kernel, after the row's reductions have read it.

    ``None`` where that is not provably safe: the logits are used outside the middle (a graph
    that also returns them), or an output of the middle aliases them, or no single output
    matches the tile's shape, dtype and strides.
    """
    call = next((n for n in split.graph.nodes if n.op == "call_module" and n.target == "submod_1"), None)
    middle = split.submod_1
    placeholders = [n for n in middle.graph.nodes if n.op == "placeholder"]
    index = next((i for i, n in enumerate(placeholders) if n.name == logits_name), None)
    if call is None or index is None or len(call.args[index].users) != 1:
        return None
    logits = placeholders[index]
    results, single = _results(middle)
    if _aliases_of(logits) & set(results):
        return None
    tile = logits.meta.get("val")
    if not isinstance(tile, torch.Tensor):
        return None

    def same_buffer_shape(node):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return (
            isinstance(val, torch.Tensor)
            and val.shape == tile.shape
            and val.dtype == tile.dtype
            and val.stride() == tile.stride()
        )

    matches = [i for i, node in enumerate(results) if same_buffer_shape(node)]
    if len(matches) != 1:
        return None
    position = matches[0]
    rewritten = copy.deepcopy(middle)
    graph = rewritten.graph
    new_placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    new_output = next(n for n in graph.nodes if n.op == "output")
    new_results, _ = _results(rewritten)
    with graph.inserting_before(new_output):
        graph.call_function(aten.copy_.default, (new_placeholders[index], new_results[position]))
    new_output.args = (tuple(r for i, r in enumerate(new_results) if i != position),)
    graph.lint()
    rewritten.recompile()
    return rewritten, (index, None if single else position)


def _example_inputs(graph_module: torch.fx.GraphModule, device: torch.device) -> list[torch.Tensor]:
    example = []
    for node in graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise RuntimeError("tile_pass: the tile graph lost its shape metadata")
        # the strides it will be called with (an expanded token weight is not contiguous)
        example.append(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device).zero_())
    return example


def _middle_with_store(split: torch.fx.GraphModule, logits_name: str, key):
    """``split``'s middle, rewritten to store the logits gradient over the logits where that is
    safe, and what it overwrites (see :func:`_store_grad_over_logits`)."""
    in_place = _store_grad_over_logits(split, logits_name) if STORE_GRAD_OVER_LOGITS else None
    if in_place is None:
        log.debug("the logits gradient of tile %s gets its own buffer", key)
        return split.submod_1, None
    return in_place


def _compile_middle(split: torch.fx.GraphModule, key, logits_name: str, block=None) -> None:
    """Compile ``split.submod_1`` with Inductor (no Dynamo: it is already an aten graph),
    storing the logits gradient over the logits tile where that is safe. ``block``: the same
    tile function split at fewer rows, ``(split, logits_name)``; where its middle is the tile's
    middle row by row, that one is compiled and run block after block (see :class:`_RowBlocked`)."""
    from torch._inductor.compile_fx import compile_fx

    middle, overwritten = _middle_with_store(split, logits_name, key)
    simplify(middle)
    blocked = None
    if block is not None:
        block_middle, block_overwritten = _middle_with_store(*block, key)
        simplify(block_middle)
        tokens = _token_rows(middle, block_middle) if block_overwritten == overwritten else None
        if tokens is not None:
            middle, blocked = block_middle, tokens
    label_column = overwritten is not None and split_label_column(middle, overwritten[0])
    with torch.no_grad():
        compiled = compile_fx(middle, _example_inputs(middle, key.device))
    if label_column:
        compiled = _WithLabelColumn(compiled, overwritten[0])
    if blocked is None:
        split.submod_1 = _Compiled(compiled, overwritten)
    else:
        split.submod_1 = _RowBlocked(compiled, overwritten, *blocked)


class _WithLabelColumn:
    """A compiled middle that stored the logits gradient without its label column, and
    returned the column last (:func:`tile_pass._simplify.split_label_column`): the column is
    stored into the logits input here, one element per row, and the other outputs returned."""

    def __init__(self, fn, logits_index: int):
        self.fn, self.logits_index = fn, logits_index

    def __call__(self, *args):
        *outputs, label, value = self.fn(*args)
        logits = args[self.logits_index]
        # an indexed store (``scatter_`` on the CPU would widen a half-precision tile to float32)
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits.index_put_((rows, label.view(-1)), value.view(-1))
        return tuple(outputs)


def _results(gm: torch.fx.GraphModule) -> tuple[list, bool]:
    """What a graph returns, in order, and whether it returns one value rather than a tuple."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    single = isinstance(out, torch.fx.Node)
    return ([out] if single else list(out)), single


def _returned(gm: torch.fx.GraphModule) -> list | None:
    """The values a graph returns, in order (``None`` unless each is a traced tensor)."""
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in _results(gm)[0]]
    return vals if all(isinstance(v, torch.Tensor) for v in vals) else None


def _token_rows(middle: torch.fx.GraphModule, block: torch.fx.GraphModule):
    """``(rows, token_inputs, outputs, returns_one)`` when ``block`` is ``middle`` on ``rows`` of its tokens,
    else ``None``. Each input has the same layout in both, or is a token input: the same
    trailing shape, strides and dtype, with the token count first. Each output is per token
    and small (a few values per token; the logits gradient stored over the logits is no
    output). The tile functions are row-wise by construction, as any tile size gives the same
    per-token results; this checks that the two traces agree with that."""
    inputs = [[n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"] for gm in (middle, block)]
    outputs = [_returned(middle), _returned(block)]
    if None in outputs or not outputs[0] or len(outputs[0]) != len(outputs[1]):
        return None
    if len(inputs[0]) != len(inputs[1]) or not all(isinstance(v, torch.Tensor) for v in sum(inputs, [])):
        return None
    tile = outputs[0][0].shape[0] if outputs[0][0].dim() else 0
    rows = outputs[1][0].shape[0] if outputs[1][0].dim() else 0
    if not 0 < rows < tile or tile % rows:
        return None

    def per_token(full, part) -> bool:
        return (
            full.dim() > 0
            and (full.shape[0], part.shape[0]) == (tile, rows)
            and full.shape[1:] == part.shape[1:]
            and full.stride() == part.stride()
            and full.dtype == part.dtype
        )

    token_inputs = []
    for full, part in zip(*inputs, strict=True):
        if per_token(full, part):
            token_inputs.append(True)
        elif full.shape == part.shape and full.dtype == part.dtype and full.stride() == part.stride():
            token_inputs.append(False)
        else:
            return None
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    shared = {p for p, token in zip(placeholders, token_inputs, strict=True) if not token}
    if _written_inputs(block) & shared:  # e.g. a bias-gradient sum added into: blocks would reorder it
        return None
    if not any(token_inputs) or not all(
        per_token(f, p) and f.numel() <= 64 * tile for f, p in zip(*outputs, strict=True)
    ):
        return None
    layouts = tuple((tuple(f.shape), f.dtype) for f in outputs[0])
    return rows, tuple(token_inputs), layouts, _results(block)[1]


def _view_source(value):
    """What ``value`` is a view of, through any chain of views (``value`` itself if none)."""
    while isinstance(value, torch.fx.Node) and value.op != "placeholder" and value.target in _VIEWS:
        value = value.args[0]
    return value


def _written_inputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The placeholders an in-place op of ``gm`` writes to (through views)."""
    written = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            value = _view_source(value)
            if isinstance(value, torch.fx.Node):
                written.add(value)
    return written


class _RowBlocked(_Compiled):
    """The compiled middle of a ``rows``-token block, run block after block over a tile.

    Inductor's CPU kernel for a whole tile makes each pass over all its rows in turn (the row
    maximum, the sum of exponentials, the gradient), so every pass reads the ``[tile, V]``
    buffer from memory; on a block of a few MiB the later passes find it in cache: a
    512 x 128256 bfloat16 tile takes 102 ms instead of 122 on a 2-core Xeon. The rows are the
    same function's; the logits gradient is stored over each block of the logits, and the
    other (per-token) outputs are gathered from the blocks."""

    def __init__(self, fn, overwritten, rows: int, token_inputs: tuple[bool, ...], outputs, returns_one):
        super().__init__(fn, overwritten)
        self.rows, self.token_inputs = rows, token_inputs
        self.outputs, self.returns_one = outputs, returns_one

    def forward(self, *args):
        device = next(a.device for a, token in zip(args, self.token_inputs, strict=True) if token)
        results = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outputs]
        for start in range(0, results[0].shape[0], self.rows):
            stop = start + self.rows
            block = [a[start:stop] if token else a for a, token in zip(args, self.token_inputs, strict=True)]
            values = self.fn(*block)
            values = [values] if isinstance(values, torch.Tensor) else values
            for result, value in zip(results, values, strict=True):
                result[start:stop] = value
        return self.restore(args, results[0] if self.returns_one else tuple(results))


#: Rows of the half-precision weight-gradient product formed at a time (see below).
UPCAST_BLOCK_BYTES = 8 * 1024 * 1024


class _BlockedUpcastAccumulate(torch.nn.Module):
    """``acc += a @ b`` for half-precision ``a``, ``b`` and a float32 ``acc``, ``rows`` rows at
    a time: each block of the product is formed in the model dtype, as the derived graph
    forms it, and added by a compiled pass, so the temporary is one block, not ``[V, H]``.
    Every element is the same product over the same tokens; only where it is stored changes.
    """

    _is_impure = True  # it mutates acc and returns nothing: never dead code

    def __init__(self, rows: int, adds: dict[int, object]):
        super().__init__()
        self.rows = rows
        self.adds = adds  # block height -> compiled ``acc_block.add_(block)``

    def forward(self, acc, a, b):
        for start in range(0, acc.shape[0], self.rows):
            stop = min(start + self.rows, acc.shape[0])
            self.adds[stop - start](acc[start:stop], torch.mm(a[start:stop], b))


#: Set on the tracing thread, whose caller already holds the compile lock for it.
_tracer_state = threading.local()


def _tracing_lock():
    """Dynamo's compile lock (an ``RLock``): no FX tracing of ours overlaps a compile or
    another trace in any thread (see the module docstring)."""
    if getattr(_tracer_state, "caller_holds_lock", False):
        return contextlib.nullcontext()
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def _inductor_once(name: str, fn, examples) -> object:
    """``fn`` (in-place updates of its arguments) traced and compiled by Inductor, once per
    ``name`` and layout of ``examples`` (kept in the bounded cache). Tracing runs ``fn``, so it
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


def _add_(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x)


def _compiled_add(acc: torch.Tensor, x: torch.Tensor):
    """``acc.add_(x)`` compiled by Inductor, once per layout: the weight-gradient sum has the
    same shape for every tile size, so the kernels of other tile sizes reuse it."""
    return _inductor_once("add", _add_, (acc, x))


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
#: :func:`_inductor_once`'s kernels by name and layout.
_compiled_adds = _BoundedCache(64)


def _graph_nodes(root: torch.fx.GraphModule):
    """Every ``(graph module, node)`` of ``root`` and of the graph modules nested in it (the
    parts of a split tile), listed up front so that a pass may add and erase nodes."""
    for module in [m for m in root.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in list(module.graph.nodes):
            yield module, node


def _recompile_all(root: torch.fx.GraphModule) -> None:
    for module in root.modules():
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()


def _block_heights(rows: int, block_rows: int) -> set[int]:
    """The heights of the row blocks ``rows`` rows are cut into, ``block_rows`` at a time."""
    return {min(block_rows, rows), rows % block_rows if rows > block_rows else 0} - {0}


def _compile_upcast_accumulation(root: torch.fx.GraphModule, device: torch.device) -> int:
    """Compile each ``acc.add_(x)`` whose ``x`` is narrower than ``acc`` with Inductor.

    A half-precision tile's weight gradient is added into the float32 sum once per tile.
    Eager ``add_`` with mixed dtypes converts through a temporary; Inductor makes it one
    vectorised pass (a ``[32000, 512]`` bf16 tile into float32 on 2 CPU cores: 24.5 ms
    eager, 3.0 ms compiled). Where ``x`` is a product ``a @ b`` used nowhere else, it is
    formed and added in blocks of rows (:class:`_BlockedUpcastAccumulate`).
    """
    compiled = 0
    for gm, node in _graph_nodes(root):
        if node.op == "call_module":
            continue
        if node.target is not aten.add_.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args]
        if not all(isinstance(v, torch.Tensor) for v in vals) or vals[0].dtype == vals[1].dtype:
            continue
        acc, update = node.args
        product = _strip_transpose_pairs(update)
        name = f"_accumulate_{compiled}"
        rows = max(1, UPCAST_BLOCK_BYTES // max(1, vals[1][0].numel() * vals[1].element_size()))
        blocked = (
            product.target is aten.mm.default
            and len(update.users) == 1
            and all(len(n.users) == 1 for n in _chain_to(update, product))
            and vals[0].dim() == 2
            and vals[0].is_contiguous()
            and rows < vals[0].shape[0]
        )
        if blocked:
            heights = _block_heights(vals[0].shape[0], rows)
            adds = {
                height: _compiled_add(
                    torch.empty((height, vals[0].shape[1]), dtype=vals[0].dtype, device=device),
                    torch.empty((height, vals[1].shape[1]), dtype=vals[1].dtype, device=device),
                )
                for height in heights
            }
            gm.add_submodule(name, _BlockedUpcastAccumulate(rows, adds))
            args = (acc, *product.args)
        else:
            example = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device) for v in vals]
            module = _Compiled(_compiled_add(*example))
            module._is_impure = True  # it mutates acc; its result is unused
            gm.add_submodule(name, module)
            args = node.args
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, args)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        if blocked:  # the full-size product and its views are no longer used
            for dead in _chain_to(update, product):
                gm.graph.erase_node(dead)
        compiled += 1
    _recompile_all(root)
    return compiled


def _chain_to(node: torch.fx.Node, source: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from ``node`` back to ``source`` through single-input views, inclusive."""
    chain = [node]
    while chain[-1] is not source:
        chain.append(chain[-1].args[0])
    return chain


def onednn_gemms_apply(device: torch.device) -> bool:
    """Whether a CPU tile runs its float32 ``mm`` GEMMs through oneDNN (see :func:`_onednn_mm`);
    ``TILE_PASS_CPU_GEMM`` decides, read once (see :mod:`tile_pass._settings`)."""
    return _settings.current().cpu_gemm == "onednn" and device.type == "cpu" and _onednn_linear() is not None


@functools.cache
def _onednn_linear():
    """``mkldnn::_linear_pointwise`` (the op Inductor's CPU linear fusion calls), if this build has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def _onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` by oneDNN's matmul: the same float32 product as ``aten.mm``, summed
    in a different order.

    A tile's logits GEMM (``[tile, H] @ [H, V]``) has few rows and a very wide output, the
    shape where MKL's sgemm falls furthest behind oneDNN's brgemm on some CPUs: on a 2-core
    AMD EPYC (Zen 4), ``[384, 1024] @ [1024, 128256]`` runs at ~155 GFLOP/s through
    ``aten.mm`` and ~190 through oneDNN, and a whole tile is 10-20% faster. oneDNN reads
    ``b`` in either layout without a copy. Anything but two non-empty float32 CPU matrices
    goes to aten.
    """
    matrices = a.dim() == b.dim() == 2 and a.numel() > 0 and b.numel() > 0 and a.device.type == "cpu"
    if matrices and a.dtype is torch.float32 and b.dtype is torch.float32:
        return _onednn_linear()(a, b.t(), bias, "none", [], "")
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _route_gemms_to_onednn(root: torch.fx.GraphModule) -> int:
    """Replace the graph's out-of-place float32 ``mm`` (and ``addmm`` of a ``[V]`` bias) with
    :func:`_onednn_mm`; the in-place weight-gradient ``addmm_`` stays aten's."""
    routed = 0
    for gm, node in _graph_nodes(root):
        if node.op == "call_module":
            continue
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args]
        if not vals or not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in vals):
            continue
        if node.target is aten.mm.default and not node.kwargs:
            args = node.args
        elif node.target is aten.addmm.default and not node.kwargs and len(vals) == 3 and vals[0].dim() == 1:
            args = (node.args[1], node.args[2], node.args[0])
        else:
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(_onednn_mm, args)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        routed += 1
    _recompile_all(root)
    return routed


class _BlockedSplitAccumulate(torch.nn.Module):
    """``sum += a @ b`` on the planes of a split float32 sum, the product one block of rows at
    a time (see :func:`tile_pass._weight_grad.split_accumulate_mm_`)."""

    _is_impure = True  # it mutates the planes and returns nothing: never dead code

    def __init__(self, add=None, store=None, add_and_round=None):
        super().__init__()
        self.add, self.store, self.add_and_round = add, store, add_and_round

    def forward(self, hi, lo, a, b):
        _weight_grad.split_accumulate_mm_(hi, lo, a, b, self.add, self.store, self.add_and_round)


def _compiled_split_add(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    """:func:`tile_pass._weight_grad.split_add_` as one vectorized pass over a block (read both
    planes and the product, write both planes): on the CPU the C loop of
    :mod:`tile_pass._split_sum_cpu`; otherwise compiled by Inductor, once per layout, on the
    planes' int32 words where the rows pair up."""
    c_loop = _split_sum_cpu.add(hi, lo, x)
    if c_loop is not None:
        return c_loop
    words = _weight_grad.as_words(hi, lo, x)
    if words is None:
        return _inductor_once("split", _weight_grad.split_add_, (hi, lo, x))
    compiled = _inductor_once("split", _weight_grad.add_words_, words)
    return lambda hi, lo, x: compiled(*_weight_grad.as_words(hi, lo, x))


def finish_split(hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype, compiled: bool) -> torch.Tensor:
    """:func:`tile_pass._weight_grad.finish`; with ``compiled``, one vectorized pass with no
    temporaries: on the CPU the C loop of :mod:`tile_pass._split_sum_cpu`, otherwise (bfloat16
    planes whose rows pair up) an Inductor kernel over the int32 words, compiled once per
    shape. Each rounds as the eager conversion does. Planes the last tile's add already rounded
    (:func:`tile_pass._weight_grad.last_add`) are returned as they are."""
    if _weight_grad.rounded_by_last_add(hi):
        return hi.view(dtype)
    if compiled:
        rounded = _split_sum_cpu.finish(hi, lo, dtype)
        if rounded is not None:
            return rounded
    words = _weight_grad.as_words(hi, lo, lo) if compiled and dtype == torch.bfloat16 else None
    if words is None:
        return _weight_grad.finish(hi, lo, dtype)
    _inductor_once("finish", _weight_grad.round_words_, words[:2])(*words[:2])
    return hi.view(dtype)


class _SplitAddByBlockHeight:
    """The compiled per-block add for each block height a ``[V, H]`` plane is cut into."""

    def __init__(self, adds: dict[int, object]):
        self.adds = adds

    def __call__(self, hi, lo, x):
        self.adds[hi.shape[0]](hi, lo, x)


def _block_split_accumulation(root: torch.fx.GraphModule, key) -> int:
    """Turn ``split_accumulate_(hi, lo, mm(a, b))`` (modulo double transposes, the product used
    nowhere else) into a blocked product, so the tile never holds a ``[V, H]`` temporary; in
    compiled tiles each block is added by one Inductor kernel."""
    rewritten = 0
    for gm, node in _graph_nodes(root):
        if node.op == "call_module":
            continue
        if node.target is not torch.ops.tile_pass.split_accumulate_.default:
            continue
        hi, lo, update = node.args
        product = _strip_transpose_pairs(update)
        chain = _chain_to(update, product)
        if product.target is not aten.mm.default or any(len(n.users) != 1 for n in chain):
            continue
        add = store = add_and_round = None
        if key.compiled:
            V, H = key.vocab_size, key.hidden_size
            itemsize = key.weight_dtype.itemsize
            heights = _block_heights(V, _weight_grad.product_block_rows(V, H * itemsize))
            add = _SplitAddByBlockHeight({
                h: _compiled_split_add(
                    torch.empty((h, H), dtype=torch.int16, device=key.device),
                    torch.empty((h, H), dtype=torch.int16, device=key.device),
                    torch.empty((h, H), dtype=key.weight_dtype, device=key.device),
                )
                for h in heights
            })  # fmt: skip
            product_dtype = product.meta["val"].dtype if "val" in product.meta else key.weight_dtype
            row = [
                torch.empty((1, H), dtype=d, device=key.device)
                for d in (torch.int16, torch.int16, product_dtype)
            ]
            store = _split_sum_cpu.store(*row)
            add_and_round = _split_sum_cpu.add_and_round(*row, key.weight_dtype)
        name = f"_split_accumulate_{rewritten}"
        gm.add_submodule(name, _BlockedSplitAccumulate(add, store, add_and_round))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (hi, lo, *product.args))
        call.meta = dict(node.meta)
        gm.graph.erase_node(node)
        for dead in chain:
            gm.graph.erase_node(dead)
        rewritten += 1
    _recompile_all(root)
    return rewritten


def _logits_into_shared_buffer(gm: torch.fx.GraphModule, key) -> bool:
    """On the CPU, make the logits GEMM write into the tile loop's shared buffer (see
    :mod:`tile_pass._tile_buffers`). A tile's logits, and the gradient stored over them, are
    dead when its graph returns, except in what the graph returns: the tile loops copy every
    returned tile (kept logits, returned rows) into their outputs before the next tile runs.
    A float32 GEMM routed to oneDNN, which writes no given buffer, keeps its own."""
    logits = next((n for n in gm.graph.nodes if n.target in _GEMMS), None)
    if key.device.type != "cpu" or logits is None or logits.target not in _tile_buffers.REPLACES:
        return False
    tile = logits.meta.get("val")
    if logits.kwargs or not isinstance(tile, torch.Tensor) or not tile.is_contiguous():
        return False
    if key.onednn and tile.dtype == torch.float32:
        return False
    logits.target = _tile_buffers.REPLACES[logits.target]
    gm.recompile()
    return True


def _returned_gemms_on_huge_pages(gm: torch.fx.GraphModule, key) -> int:
    """On the CPU, give each GEMM output the graph returns (the weight gradient of the only
    tile) a buffer from :func:`tile_pass._tile_buffers.empty`, which puts it on huge pages
    where it is large enough; the number rewritten. A float32 GEMM routed to oneDNN keeps its
    own, as for the logits; a GEMM whose output is summed into, not returned, is left to the
    schedules."""
    if key.device.type != "cpu":
        return 0
    moved = 0
    for node in {_view_source(result) for result in _results(gm)[0]}:
        if not isinstance(node, torch.fx.Node) or node.target is not aten.mm.default or node.kwargs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or (key.onednn and val.dtype == torch.float32):
            continue
        node.target = _tile_buffers.fresh_mm
        moved += 1
    if moved:
        gm.recompile()
    return moved


#: Bytes of logits per block of rows the compiled middle runs on the CPU (see :class:`_RowBlocked`).
MIDDLE_BLOCK_BYTES = 8 * 1024 * 1024
_MIN_MIDDLE_BLOCK = 8


def _middle_block_rows(key, logits: torch.fx.Node) -> int | None:
    """The rows of a middle block for this tile: a power of two dividing the tile, of about
    :data:`MIDDLE_BLOCK_BYTES`; ``None`` off the CPU or where the tile is about that small."""
    tile = logits.meta.get("val")
    if key.device.type != "cpu" or not isinstance(tile, torch.Tensor) or tile.dim() != 2:
        return None
    rows = _MIN_MIDDLE_BLOCK
    while (rows * 2) * tile.shape[1] * tile.element_size() <= MIDDLE_BLOCK_BYTES:
        rows *= 2
    while tile.shape[0] % rows:
        rows //= 2
    return rows if _MIN_MIDDLE_BLOCK <= rows < tile.shape[0] else None


def _split_block(key, logits: torch.fx.Node, retrace):
    """The tile function traced again at a middle block's rows and split like the tile's, as
    :func:`_compile_middle` takes it; ``None`` where the middle is not blocked."""
    rows = _middle_block_rows(key, logits) if retrace is not None else None
    if rows is None:
        return None
    gm = retrace(rows)
    _accumulate_weight_grad_in_place(gm)
    block_logits = next((n for n in gm.graph.nodes if n.target in _GEMMS), None)
    split = _split_at_gemms(gm) if block_logits is not None else None
    return None if split is None else (split, block_logits.name)


def finish_tile_graph(gm: torch.fx.GraphModule, key, retrace=None) -> torch.fx.GraphModule:
    """The passes every derived tile graph gets: the weight-gradient sum in place; on the CPU
    the logits in the loop's shared buffer; with ``key.compiled`` the elementwise middle
    compiled by Inductor; under the split schedule (``key.weight_grad == "split"``) the planes'
    sum in row blocks; then, with ``key.onednn``, the float32 GEMMs on oneDNN. ``key`` needs
    ``compiled``, ``device`` and ``onednn`` (and, for the split schedule, ``vocab_size``,
    ``hidden_size`` and ``weight_dtype``). ``retrace(rows)``: the same tile function traced at
    ``rows`` tokens, for the CPU's blocked middle (without it the middle runs whole)."""
    _accumulate_weight_grad_in_place(gm)
    _logits_into_shared_buffer(gm, key)
    _returned_gemms_on_huge_pages(gm, key)
    if key.compiled:
        logits = next((n for n in gm.graph.nodes if n.target in _GEMMS), None)
        split = _split_at_gemms(gm)
        if split is not None:
            _compile_middle(split, key, logits.name, _split_block(key, logits, retrace))
            gm = split
        _compile_upcast_accumulation(gm, key.device)
    if getattr(key, "weight_grad", None) == "split":
        _block_split_accumulation(gm, key)
    if key.onednn:
        log.debug("tile %s: %d GEMMs on oneDNN", key, _route_gemms_to_onednn(gm))
    return gm


def trace_fake(
    fn, inputs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> torch.fx.GraphModule:
    """``fn`` traced by ``make_fx`` on zero-filled fake inputs of these shapes and dtypes."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        examples = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in inputs]
    return make_fx(fn, tracing_mode="fake")(*examples)


_cache = _BoundedCache(TILE_KERNEL_CACHE_SIZE)
_cache_lock = threading.Lock()
_tracer: concurrent.futures.ThreadPoolExecutor | None = None


def traced_once(key, trace):
    """``trace(key)``, run once per process on the tracing thread (see the module docstring)
    and kept in the bounded cache of tile functions."""
    global _tracer
    with _cache_lock:
        kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _tracing_lock(), _cache_lock:
        kernel = _cache.get(key)
        if kernel is None:
            if _tracer is None:
                _tracer = concurrent.futures.ThreadPoolExecutor(1, "tile_pass_tracer")
            kernel = _cache.put(key, _tracer.submit(_on_tracing_thread, trace, key).result())
    return kernel


def _on_tracing_thread(trace, key):
    _tracer_state.caller_holds_lock = True
    return trace(key)


def on_tracing_thread(trace):
    """``trace()`` on the tracing thread, under the compile lock, uncached: for traces that are
    not tile functions (tile_pass._token_weights)."""
    global _tracer
    with _tracing_lock():
        with _cache_lock:
            if _tracer is None:
                _tracer = concurrent.futures.ThreadPoolExecutor(1, "tile_pass_tracer")
        return _tracer.submit(_on_tracing_thread, lambda _: trace(), None).result()


def clear_caches() -> None:
    """Drop every traced tile function, compiled accumulation kernel and derived token-weight
    graph (they are rebuilt on next use); ``torch._dynamo.reset()`` does not reach them."""
    with _cache_lock:
        for cache in list(_every_cache):
            cache.clear()
