"""The elementwise middle of a tile compiled by Inductor.

The derived tile graph is split at its GEMMs (:func:`_split_at_gemms`): the middle takes the
logits tile and returns the losses and the logits gradient. Inductor fuses it into a few passes
over the tile, storing the logits gradient over the logits where that is safe
(:func:`_store_grad_over_logits`), after the exact rewrites of :mod:`tile_pass.tiles._simplify`; the
GEMMs stay library calls. On the CPU the middle runs block after block of rows
(:class:`_RowBlocked`), from the same tile function traced at a block's rows: the pass loop
keeps that retrace in ``gm.meta[RETRACE]``.
"""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from tile_pass._logging import log
from tile_pass.plan._tiling import STORE_GRAD_OVER_LOGITS
from tile_pass.tiles._simplify import simplify, split_label_column
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes import _graph, accumulate_in_place

aten = torch.ops.aten

#: ``gm.meta`` key of ``retrace(rows)``: the tile function traced again at ``rows`` tokens
RETRACE = "tile_pass_retrace"


def run(gm: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    """The graph split at its GEMMs, its middle compiled (``gm`` itself where it has no middle)."""
    logits = _graph.logits_gemm(gm)
    split = _split_at_gemms(gm)
    if split is None:
        return gm
    _compile_middle(split, key, logits.name, _split_block(key, logits, gm))
    return split


def _split_at_gemms(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """Split the derived tile graph into GEMMs and the elementwise middle between them.

    ``submod_1`` of the result takes the logits tile and returns the losses and the logits
    gradient (everything that depends on the logits but on no backward GEMM); Inductor
    fuses it into a few passes over the tile, while the GEMMs, including the in-place
    weight-gradient ``addmm_``, stay library calls. ``None`` if the graph has no such shape.
    """
    nodes = list(gm.graph.nodes)
    logits = next((n for n in nodes if n.target in _graph.GEMMS), None)
    if logits is None:
        return None
    on_logits, after_gemm = set(), set()
    for n in nodes:
        if n is logits or any(a in on_logits for a in n.all_input_nodes):
            on_logits.add(n)
        if n in on_logits and n is not logits and n.target in _graph.GEMMS:
            after_gemm.add(n)
        elif any(a in after_gemm for a in n.all_input_nodes):
            after_gemm.add(n)

    def feeds_gemm_only(n):  # views whose every use is a backward GEMM
        return (
            n.target in _graph.VIEWS
            and n.users
            and all((u in after_gemm and u.target in _graph.GEMMS) or feeds_gemm_only(u) for u in n.users)
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
            and n.target not in _graph.GEMMS
            and users
            and len(users) == len(n.users)
            and all(partition.get(u) == 1 for u in users)
        ):
            partition[n] = 1
    return split_module(gm, None, lambda n: partition[n])


class Compiled(torch.nn.Module):
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
        return (*outputs[:position], args[arg], *outputs[position:])


def _aliases_of(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every view taken of it (transitively)."""
    found, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user.target in _graph.VIEWS and user not in found:
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
    results, single = _graph.results(middle)
    if _aliases_of(logits) & set(results):
        return None
    tile = logits.meta.get("val")
    if not isinstance(tile, torch.Tensor):
        return None

    vals = [node.meta.get("val") if isinstance(node, torch.fx.Node) else None for node in results]
    matches = [i for i, val in enumerate(vals) if isinstance(val, torch.Tensor) and _same_layout(val, tile)]
    if len(matches) != 1:
        return None
    position = matches[0]
    rewritten = copy.deepcopy(middle)
    graph = rewritten.graph
    new_placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    new_output = next(n for n in graph.nodes if n.op == "output")
    new_results, _ = _graph.results(rewritten)
    with graph.inserting_before(new_output):
        graph.call_function(aten.copy_.default, (new_placeholders[index], new_results[position]))
    new_output.args = (tuple(r for i, r in enumerate(new_results) if i != position),)
    graph.lint()
    rewritten.recompile()
    return rewritten, (index, None if single else position)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and strides: one can be stored where the other is."""
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


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
    split.submod_1 = (
        Compiled(compiled, overwritten) if blocked is None else _RowBlocked(compiled, overwritten, *blocked)
    )


class _WithLabelColumn:
    """A compiled middle that stored the logits gradient without its label column, and
    returned the column last (:func:`tile_pass.tiles._simplify.split_label_column`): the column is
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


def _returned(gm: torch.fx.GraphModule) -> list | None:
    """The values a graph returns, in order (``None`` unless each is a traced tensor)."""
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in _graph.results(gm)[0]]
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

    pairs = list(zip(*inputs, strict=True))
    if not all(per_token(full, part) or _same_layout(full, part) for full, part in pairs):
        return None
    token_inputs = [per_token(full, part) for full, part in pairs]
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    shared = {p for p, token in zip(placeholders, token_inputs, strict=True) if not token}
    if _written_inputs(block) & shared:  # e.g. a bias-gradient sum added into: blocks would reorder it
        return None
    if not any(token_inputs) or not all(
        per_token(f, p) and f.numel() <= 64 * tile for f, p in zip(*outputs, strict=True)
    ):
        return None
    layouts = tuple((tuple(f.shape), f.dtype) for f in outputs[0])
    return rows, tuple(token_inputs), layouts, _graph.results(block)[1]


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
            value = _graph.view_source(value)
            if isinstance(value, torch.fx.Node):
                written.add(value)
    return written


class _RowBlocked(Compiled):
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


#: Bytes of logits per block of rows the compiled middle runs on the CPU (see :class:`_RowBlocked`).
MIDDLE_BLOCK_BYTES = 8 * 1024 * 1024
_MIN_MIDDLE_BLOCK = 8


def _middle_block_rows(key, logits: torch.fx.Node, gm: torch.fx.GraphModule) -> int | None:
    """The rows of a middle block for this tile: a power of two dividing the tile, of about
    :data:`MIDDLE_BLOCK_BYTES` over the logits and every other ``[tile, V]`` input the middle
    reads (a distillation's teacher log-probabilities); ``None`` off the CPU or where the tile
    is about that small."""
    tile = logits.meta.get("val")
    if key.device.type != "cpu" or not isinstance(tile, torch.Tensor) or tile.dim() != 2:
        return None
    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    tiles = [t for t in [tile, *inputs] if isinstance(t, torch.Tensor) and t.shape == tile.shape]
    row_bytes = sum(t.shape[1] * t.element_size() for t in tiles)
    rows = _MIN_MIDDLE_BLOCK
    while (rows * 2) * row_bytes <= MIDDLE_BLOCK_BYTES:
        rows *= 2
    while tile.shape[0] % rows:
        rows //= 2
    return rows if _MIN_MIDDLE_BLOCK <= rows < tile.shape[0] else None


def _split_block(key, logits: torch.fx.Node, gm: torch.fx.GraphModule):
    """The tile function traced again at a middle block's rows and split like the tile's, as
    :func:`_compile_middle` takes it; ``None`` where the middle is not blocked."""
    retrace = gm.meta.get(RETRACE)
    rows = _middle_block_rows(key, logits, gm) if retrace is not None else None
    if rows is None:
        return None
    gm = retrace(rows)
    accumulate_in_place.run(gm)
    split = _split_at_gemms(gm)  # None where the graph has no GEMM
    return None if split is None else (split, _graph.logits_gemm(gm).name)
