"""Facts about Dynamo graph nodes that every phase of the matcher reads, and how it says no."""

from __future__ import annotations

import operator
import re
from collections.abc import Hashable

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tile_pass.program._region import target_name

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>.*)')


def source_line(node) -> str:
    """``file:line (function): code`` of the user frame that produced ``node``, or ``?``."""
    trace = node.meta.get("stack_trace") if node is not None else None
    frames = list(_FRAME.finditer(trace or ""))
    if not frames:
        return "?"
    last = frames[-1]
    path = last["file"].rsplit("/", 1)[-1]
    return f"{path}:{last['line']} ({last['func']}): {last['code'].strip()}"


class NoMatch(Exception):
    """Why a candidate cannot be rewritten exactly, in plain language. As Inductor's ``FailedMatch``,
    the text is formatted when read (each fx node in ``format_args`` shown by :func:`describe`);
    ``node`` is the node that stopped the region (by default the first one the text names),
    ``depends`` the nodes computed from the logits, whose own reports this one replaces;
    ``eager_raises``: eager raises on this input, so a compiler that accepts it (Inductor) runs
    what eager refuses, and the user is warned. A reason is not changed once raised:
    :meth:`but` makes a new one."""

    def __init__(
        self, format_string: str, *format_args, node: torch.fx.Node | None = None, eager_raises: bool = False,
        depends: frozenset[torch.fx.Node] = frozenset(),
    ):  # fmt: skip
        super().__init__(format_string, *format_args)
        self.format_string, self.format_args, self.eager_raises = format_string, format_args, eager_raises
        self.node = node or next((a for a in format_args if isinstance(a, torch.fx.Node)), None)
        self.depends = frozenset(depends)

    def but(self, *, node: torch.fx.Node | None = None, depends=None) -> NoMatch:
        """This reason, naming ``node`` where it names none, and with ``depends`` if given."""
        return NoMatch(
            self.format_string, *self.format_args, node=self.node or node, eager_raises=self.eager_raises,
            depends=self.depends if depends is None else depends,
        )  # fmt: skip

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


# How a 2-D weight's transpose may appear in a Dynamo graph: each torch version records a property
# its own way (``W.T`` / ``W.mT`` were ``getattr(W, "T")`` up to torch 2.13, ``aten.numpy_T`` /
# ``aten.mT`` op packets from 2.14) and a method as ``call_method`` or as the ``torch.*`` function.
# Every spelling is reduced to its name, then to one fact: whether it swaps the two dims of its input.
_SWAPS = {"t", "T", "mT", "numpy_T"}  # on a 2-D tensor, a swap of its dims
_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}  # (a, b): a swap iff a != b
_LAYOUT_NAMES = _SWAPS | _TRANSPOSES | {"permute", "contiguous"}  # contiguous(): the same values
_LAYOUT_FUNCTIONS = {
    function: name
    for name in _LAYOUT_NAMES
    for owner in (torch, torch.Tensor)
    if callable(function := getattr(owner, name, None))
} | {
    op: name
    for name in _LAYOUT_NAMES
    if (packet := getattr(torch.ops.aten, name, None)) is not None
    for op in (packet, *(getattr(packet, overload) for overload in packet.overloads()))
}


def _layout_step(node) -> tuple[torch.fx.Node, bool] | None:
    """``(input, swaps)`` if ``node`` only lays out a 2-D ``input`` again (``_LAYOUT_NAMES``, however
    it was recorded), ``swaps`` whether it exchanges the two dims."""
    if not isinstance(node, torch.fx.Node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    source, rest = node.args[0], list(node.args[1:])
    name = None
    if node.op == "call_method" and node.target in _LAYOUT_NAMES:
        name = node.target
    elif node.op == "call_function" and node.target is getattr:
        name, rest = (rest[0] if rest in (["T"], ["mT"]) else None), []
    elif node.op == "call_function" and isinstance(node.target, Hashable):
        name = _LAYOUT_FUNCTIONS.get(node.target)
    source_val = val(source)
    if name is None or source_val is None or source_val.dim() != 2:
        return None
    if name == "contiguous":
        return source, False
    if name in _SWAPS:
        return (source, True) if not rest and not node.kwargs else None
    dims = rest + [node.kwargs[k] for k in ("dim0", "dim1", "axis0", "axis1", "dims") if k in node.kwargs]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = list(dims[0])  # permute((1, 0)), permute(dims=[1, 0])
    if len(dims) != 2 or not all(type(d) is int and -2 <= d < 2 for d in dims):
        return None
    first, second = (d % 2 for d in dims)
    if name == "permute":
        return (source, first == 1) if first != second else None
    return source, first != second


def transposed_weight(node) -> torch.fx.Node | None:
    """A 2-D ``W`` whose dims ``node`` holds swapped, through a chain of layout-only ops however the
    torch version recorded them: ``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)`` (or ``(-1, -2)``,
    ``swapaxes``, ``swapdims``), ``W.permute(1, 0)``, ``torch.t(W)``, each with ``.contiguous()``
    before or after it. The deepest such ``W`` (``W.T.T.T``: ``W``; ``W.T.T``: ``W.T``); ``None``
    where no step of the chain swaps (``W.contiguous()`` is ``W`` itself, not its transpose)."""
    weight, swapped = None, False
    while (step := _layout_step(node)) is not None:
        node, swaps = step
        swapped ^= swaps
        weight = node if swapped else weight
    return weight


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
                "the matmul's right operand is not a transposed 2-D weight (W.t(), W.T, W.mT, "
                "W.transpose(0, 1), W.permute(1, 0), contiguous or not), "
                "so it is not recognised as an LM head"
            )
        return node.args[0], weight, None, node.args[1], "hidden @ W.T"
    return None


def projection_of(node: torch.fx.Node):
    """:func:`as_linear`'s answer, or ``None`` for a matmul of something else (no 2-D weight)."""
    try:
        return as_linear(node)
    except NoMatch:
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


def permutation(node: torch.fx.Node, ndim: int) -> list[int] | None:
    """The dims order ``x.permute(order)`` of a ``transpose``/``swapaxes``/``permute``/``movedim``
    node of an ``ndim``-d tensor, as constants; None when they are not plain ints."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    args = list(node.args[1:])
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = [
            node.kwargs.get(k, args[i] if i < len(args) else None) for i, k in enumerate(("dim0", "dim1"))
        ]
        if not all(isinstance(d, int) for d in dims):
            return None
        order = list(range(ndim))
        a, b = (d % ndim for d in dims)
        order[a], order[b] = order[b], order[a]
        return order
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        dims = node.kwargs.get("dims", dims)
        if len(dims) != ndim or not all(isinstance(d, int) for d in dims):
            return None
        return [d % ndim for d in dims]
    if name in ("movedim", "moveaxis"):
        source = node.kwargs.get("source", args[0] if args else None)
        destination = node.kwargs.get("destination", args[1] if len(args) > 1 else None)
        source = [source] if isinstance(source, int) else list(source or ())
        destination = [destination] if isinstance(destination, int) else list(destination or ())
        if len(source) != len(destination) or not all(isinstance(d, int) for d in source + destination):
            return None
        return _moved(ndim, source, destination)
    return None


def _moved(ndim: int, source: list[int], destination: list[int]) -> list[int]:
    source, destination = [d % ndim for d in source], [d % ndim for d in destination]
    rest = iter(d for d in range(ndim) if d not in source)
    order = [None] * ndim
    for s, d in zip(source, destination, strict=True):
        order[d] = s
    return [o if o is not None else next(rest) for o in order]
