"""Facts about Dynamo graph nodes that every phase of the matcher reads, and how it says no."""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tile_pass._region import target_name
from tile_pass.report import source_line


class NoMatch(Exception):
    """Why a candidate cannot be rewritten exactly, in plain language. As Inductor's ``FailedMatch``,
    the text is formatted when read (each fx node in ``format_args`` shown by :func:`describe`);
    ``node`` is the node that stopped the region (by default the first one the text names),
    ``depends`` the nodes computed from the logits, whose own reports this one replaces."""

    def __init__(self, format_string: str, *format_args, node: torch.fx.Node | None = None):
        super().__init__(format_string, *format_args)
        self.format_string, self.format_args = format_string, format_args
        self.node = node or next((a for a in format_args if isinstance(a, torch.fx.Node)), None)
        self.depends: set[torch.fx.Node] = set()

    def __str__(self) -> str:
        return self.format_string.format(
            *(describe(a) if isinstance(a, torch.fx.Node) else a for a in self.format_args)
        )


def describe(node: torch.fx.Node) -> str:
    """```name` at file:line (function): code``, how reasons name a node."""
    if node.op == "output":
        return "the graph output"
    name = target_name(node.target)
    return f"`{'.' + name + '()' if node.op == 'call_method' else name}` at {source_line(node)}"


_LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "__matmul__", "mm"}


def val(node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast is on with for ``device_type`` here, or ``None``."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


def transposed_weight(node) -> torch.fx.Node | None:
    """``W`` if ``node`` is ``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)`` or ``W.permute(1, 0)``."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    source = node.args[0]
    source_val = val(source)
    if source_val is None or source_val.dim() != 2:
        return None
    target, rest = node.target, tuple(node.args[1:])
    transposes = (
        (node.op == "call_method" and target == "t" or target is torch.t)
        or (node.op == "call_function" and target is getattr and rest in (("T",), ("mT",)))
        or (target in ("transpose", torch.transpose) and {d % 2 for d in rest} == {0, 1})
        or (target == "permute" and [d % 2 for d in rest] == [1, 0])
    )
    return source if transposes else None


def as_linear(node: torch.fx.Node):
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
        weight = transposed_weight(node.args[1])
        if weight is None:
            raise NoMatch(
                "the matmul's right operand is not a transposed 2-D weight (W.t() / W.T), "
                "so it is not recognised as an LM head"
            )
        return node.args[0], weight, None, node.args[1], "hidden @ W.T"
    return None


def leading_index(node: torch.fx.Node, ndim: int) -> tuple | None:
    """The index of ``x[index]`` made explicit, if it only selects leading (token) dims."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, (torch.fx.Node, bool)) for i in index):
        return None  # new axes, tensor or symbolic indices: not a plain row selection
    if index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        explicit = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1 :]
    else:
        explicit = index + (slice(None),) * (ndim - len(index))
    if len(explicit) != ndim or explicit[-1] != slice(None):
        return None
    return explicit
