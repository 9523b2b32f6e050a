"""Find ``linear -> [views, casts] -> cross_entropy`` regions in a Dynamo graph and rewrite them.

The graph is Dynamo's torch-level FX graph: ``torch._C._nn.linear`` / ``matmul`` nodes,
``call_method`` views and casts, one ``F.cross_entropy`` call. Every node carries
``meta["example_value"]`` (a fake tensor, possibly with symbolic sizes), which is how a
match is proven exact: shapes, dtypes and the single-consumer property are checked on it,
and anything unproven leaves the region untouched with a reason a user can act on.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

from tile_pass._tiling import choose_tile_tokens
from tile_pass.report import GraphReport, Rewrite, Skip, source_line
from tile_pass.tiled_loss import linear_cross_entropy

_LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "__matmul__", "mm"}
_VIEW_METHODS = {"view", "reshape", "flatten", "contiguous"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten}
_CAST_METHODS = {"float", "to", "type"}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


class _NoMatch(Exception):
    """Raised with the plain-language reason a candidate cannot be rewritten exactly."""


@dataclass
class Region:
    """One matched region, with everything the rewrite needs."""

    loss: torch.fx.Node
    linear: torch.fx.Node
    hidden: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    target: torch.fx.Node
    between: list[torch.fx.Node]  # views and casts from the linear to the loss input
    transpose: torch.fx.Node | None
    upcast: bool
    ignore_index: int
    reduction: str
    label_smoothing: float
    form: str


def _val(node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _describe(node: torch.fx.Node) -> str:
    if node.op == "output":
        return "the graph output (the function returns them)"
    if node.op == "call_method":
        name = f".{node.target}()"
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
    else:
        name = str(node.target)
    return f"`{name}` at {source_line(node)}"


def _only_consumer(node: torch.fx.Node, consumer: torch.fx.Node) -> None:
    others = [u for u in node.users if u is not consumer]
    if others:
        raise _NoMatch(
            f"the logits are also consumed by {', '.join(_describe(u) for u in others)}, "
            "so they must exist whole; compute that from the loss or drop it to get the tiled loss"
        )


def _transposed_weight(node) -> torch.fx.Node | None:
    """``W`` if ``node`` is ``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)`` or ``W.permute(1, 0)``."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    source = node.args[0]
    source_val = _val(source)
    if source_val is None or source_val.dim() != 2:
        return None
    target, rest = node.target, tuple(node.args[1:])
    if node.op == "call_method" and target == "t" or target is torch.t:
        return source
    if node.op == "call_function" and target is getattr and rest in (("T",), ("mT",)):
        return source
    if target in ("transpose", torch.transpose) and {d % 2 for d in rest} == {0, 1}:
        return source
    if target == "permute" and [d % 2 for d in rest] == [1, 0]:
        return source
    return None


def _as_linear(node: torch.fx.Node):
    """``(hidden, weight, bias, transpose_node, form)`` if ``node`` is an LM-head projection."""
    if node.op == "call_function" and node.target in _LINEAR_TARGETS:
        args = list(node.args) + [None] * (3 - len(node.args))
        hidden = node.kwargs.get("input", args[0])
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        return hidden, weight, bias, None, "F.linear" + ("(+bias)" if bias is not None else "")
    is_matmul = (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS
    )
    if is_matmul and len(node.args) == 2 and not node.kwargs:
        weight = _transposed_weight(node.args[1])
        if weight is None:
            raise _NoMatch(
                "the matmul's right operand is not a transposed 2-D weight (W.t() / W.T), "
                "so it is not recognised as an LM head"
            )
        return node.args[0], weight, None, node.args[1], "hidden @ W.T"
    return None


def _upcasts_to_float32(node: torch.fx.Node) -> bool:
    out, inp = _val(node), _val(node.args[0])
    if out is None or inp is None:
        raise _NoMatch("a cast between the linear and the loss has no shape information")
    if node.target == "to" and any(
        isinstance(a, (torch.device, str)) for a in list(node.args[1:]) + [node.kwargs.get("device")]
    ):
        raise _NoMatch("the logits are moved to another device before the loss")
    if out.dtype != torch.float32:
        raise _NoMatch(f"the logits are cast to {out.dtype} before the loss (only a float32 upcast is tiled)")
    if inp.dtype == torch.float64:
        raise _NoMatch("the float64 logits are cast down to float32 before the loss")
    if out.device != inp.device:
        raise _NoMatch("the logits are moved to another device before the loss")
    return inp.dtype != torch.float32


def _cross_entropy_options(loss: torch.fx.Node) -> dict:
    try:
        bound = _CE_SIGNATURE.bind(*loss.args, **loss.kwargs)
    except TypeError as err:
        raise _NoMatch(f"cross_entropy was called with arguments its signature rejects ({err})") from None
    bound.apply_defaults()
    options = dict(bound.arguments)
    if options["weight"] is not None:
        raise _NoMatch(
            "cross_entropy has class weights (weight=...), which the tiled loss does not support yet"
        )
    if options["size_average"] is not None or options["reduce"] is not None:
        raise _NoMatch("cross_entropy uses the deprecated size_average/reduce arguments; pass reduction=...")
    for name, kinds in (("ignore_index", int), ("reduction", str), ("label_smoothing", (int, float))):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise _NoMatch(
                f"cross_entropy's {name} is not a compile-time constant ({value!r}); "
                "the tiled loss needs it fixed when the graph is compiled"
            )
    if options["reduction"] not in ("mean", "sum", "none"):
        raise _NoMatch(f"cross_entropy has reduction={options['reduction']!r}")
    if not 0.0 <= options["label_smoothing"] <= 1.0:
        raise _NoMatch("label_smoothing is outside [0, 1]; eager raises for it, so it is left to eager")
    return options


def match_region(loss: torch.fx.Node) -> Region:
    """The region ending at cross_entropy node ``loss``; raises ``_NoMatch`` with a reason."""
    options = _cross_entropy_options(loss)
    logits, target = options["input"], options["target"]
    logits_val, target_val = _val(logits), _val(target)
    if logits_val is None or target_val is None:
        raise _NoMatch("the loss inputs carry no shape information")
    if logits_val.dim() != 2:
        raise _NoMatch(
            f"the loss input is {logits_val.dim()}-D; only [tokens, vocab] logits are tiled "
            "(flatten with .view(-1, V) before cross_entropy)"
        )
    if target_val.is_floating_point():
        raise _NoMatch("the target holds class probabilities, not class indices")
    if target_val.dtype != torch.int64:
        raise _NoMatch(f"the target dtype is {target_val.dtype}; eager cross_entropy expects int64")
    if target_val.dim() != 1 or not _same(target_val.shape[0], logits_val.shape[0]):
        raise _NoMatch("the target shape does not match the logits' token count")

    between: list[torch.fx.Node] = []
    upcast = False
    node = logits
    while True:
        linear = _as_linear(node)
        if linear is not None:
            break
        is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or (
            node.op == "call_function" and node.target in _VIEW_FUNCTIONS
        )
        is_cast = node.op == "call_method" and node.target in _CAST_METHODS
        if not (is_view or is_cast):
            raise _NoMatch(f"the loss input comes from {_describe(node)}, not from a linear layer")
        value = _val(node)
        if value is None or value.shape[-1] is None or not _same(value.shape[-1], logits_val.shape[-1]):
            raise _NoMatch(f"{_describe(node)} changes the vocabulary dimension of the logits")
        if is_cast:
            upcast |= _upcasts_to_float32(node)
        between.append(node)
        node = node.args[0]
    hidden, weight, bias, transpose, head_form = linear

    hidden_val, weight_val, linear_val = _val(hidden), _val(weight), _val(node)
    if hidden_val is None or weight_val is None or linear_val is None:
        raise _NoMatch("the linear layer's inputs carry no shape information")
    if weight_val.dim() != 2:
        raise _NoMatch("the LM-head weight is not 2-D")
    vocab_size, hidden_size = weight_val.shape
    if not _same(hidden_val.shape[-1], hidden_size) or not _same(linear_val.shape[-1], vocab_size):
        raise _NoMatch("the hidden states do not match the LM-head weight")
    bias_val = _val(bias) if bias is not None else None
    if bias is not None and (bias_val is None or tuple(bias_val.shape) != (vocab_size,)):
        raise _NoMatch("the linear bias is not a [V] tensor")
    dtypes = {hidden_val.dtype, weight_val.dtype, linear_val.dtype}
    if bias_val is not None:
        dtypes.add(bias_val.dtype)
    if len(dtypes) != 1:
        raise _NoMatch(
            "the linear runs in a different dtype than its inputs (an autocast region?); "
            "autocast around the LM head is not tiled yet"
        )
    if not linear_val.is_floating_point():
        raise _NoMatch("the logits are not floating point")
    num_tokens = hidden_val.numel() // hidden_size if hidden_val.dim() else 0
    if not _same(num_tokens, logits_val.shape[0]):
        raise _NoMatch("the logits rows are not the hidden states' tokens")
    chain = [node, *reversed(between), loss]
    for producer, consumer in zip(chain, chain[1:], strict=False):
        _only_consumer(producer, consumer)

    steps = (
        [head_form]
        + [str(n.target) for n in reversed(between)]
        + [
            f"cross_entropy(reduction={options['reduction']}, ignore_index={options['ignore_index']}"
            + (f", label_smoothing={options['label_smoothing']}" if options["label_smoothing"] else "")
            + ")"
        ]
    )
    return Region(
        loss=loss,
        linear=node,
        hidden=hidden,
        weight=weight,
        bias=bias,
        target=target,
        between=list(reversed(between)),
        transpose=transpose,
        upcast=upcast or linear_val.dtype == torch.float32,
        ignore_index=options["ignore_index"],
        reduction=options["reduction"],
        label_smoothing=float(options["label_smoothing"]),
        form=" -> ".join(steps),
    )


def _is_cross_entropy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.cross_entropy


def _rewrite(graph: torch.fx.Graph, region: Region, tile_tokens: int) -> None:
    loss = region.loss
    with graph.inserting_before(loss):
        tiled = graph.call_function(
            linear_cross_entropy,
            (region.hidden, region.weight, region.target),
            {
                "bias": region.bias,
                "ignore_index": region.ignore_index,
                "reduction": region.reduction,
                "label_smoothing": region.label_smoothing,
                "tile_tokens": tile_tokens,
                "upcast": region.upcast,
            },
        )
    tiled.meta.update(loss.meta)
    loss.replace_all_uses_with(tiled)
    graph.erase_node(loss)
    for node in [*reversed(region.between), region.linear, region.transpose]:
        if node is not None and not node.users:
            graph.erase_node(node)


def rewrite_graph(
    gm: torch.fx.GraphModule,
    *,
    graph_index: int = 0,
    tile_tokens: int | None = None,
    tile_bytes: int | None = None,
) -> GraphReport:
    """Rewrite every exactly-matched region of ``gm`` in place; report every candidate."""
    report = GraphReport(index=graph_index)
    for loss in [n for n in gm.graph.nodes if _is_cross_entropy(n)]:
        try:
            region = match_region(loss)
        except _NoMatch as why:
            report.skipped.append(Skip(graph_index, source_line(loss), str(why)))
            continue
        logits_val, hidden_val = _val(region.linear), _val(region.hidden)
        vocab_size, hidden_size = _val(region.weight).shape
        dtype = logits_val.dtype
        # the tile only affects speed, so a symbolic vocabulary is sized by its hint, unguarded
        tile = choose_tile_tokens(
            optimization_hint(vocab_size, fallback=32768), dtype, region.upcast,
            tile_tokens=tile_tokens, tile_bytes=tile_bytes,
        )  # fmt: skip
        num_tokens = hidden_val.numel() // hidden_size
        report.rewrites.append(
            Rewrite(
                graph=graph_index,
                matmul_source=source_line(region.linear),
                loss_source=source_line(loss),
                form=region.form,
                num_tokens=_plain(num_tokens),
                hidden_size=_plain(hidden_size),
                vocab_size=_plain(vocab_size),
                dtype=str(dtype).replace("torch.", ""),
                reduction=region.reduction,
                tile_tokens=tile,
                num_tiles=_plain((num_tokens + tile - 1) // tile),
                forward_bytes_avoided=_plain(num_tokens * vocab_size * _forward_bytes(dtype, region.upcast)),
                backward_bytes_avoided=_plain(num_tokens * vocab_size * _backward_bytes(dtype)),
            )
        )
        _rewrite(gm.graph, region, tile)
    if report.rewrites:
        gm.graph.lint()
        gm.recompile()
    return report


def _forward_bytes(dtype: torch.dtype, upcast: bool) -> int:
    """Logits in the model dtype, their fp32 upcast, and the fp32 log-probs saved for backward."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + (4 if upcast and itemsize != 4 else 0) + 4


def _backward_bytes(dtype: torch.dtype) -> int:
    """The fp32 logits gradient, and its cast to the model dtype."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 4 + (itemsize if itemsize != 4 else 0)


def _plain(value) -> int | str:
    return value if isinstance(value, int) else str(value)
