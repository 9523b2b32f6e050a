"""Second derivatives through a tiled region: an error where they are requested, never a wrong number.

The regions' backward scales gradients formed in forward (or re-runs the tiles once), so it is
exact to first order only. Eagerly, the ops' own backward sees grad mode on under
``create_graph=True`` and raises. Under a compiled backend it cannot: AOTAutograd traces that
backward once, with grad mode off, and at run time its compiled backward, whose saved
tensors are the detached gradients, hands a ``create_graph`` request a graph connected to
nothing, so the second derivative came back as ``None``/zero. The backend therefore wraps
every output of a rewritten graph that depends on a region in :class:`_FirstOrderOnly`, an
identity whose backward runs eagerly, first, with the caller's grad mode.

A scalar-loss op used *inside someone else's* ``torch.compile`` (the functional API under a
plain backend) gets no such wrapper. Its backward applies the chain rule through
:func:`scaled_by_upstream`, an opaque op that also takes the region's inputs (hidden states,
weight, bias) as *anchors* while AOTAutograd traces it: they are saved for backward, so a
``create_graph`` request reaches AOTAutograd's own "does not currently support double
backward" error instead of a graph connected to nothing. Under tile_pass's backend, whose
wrapper already refuses the request, no anchor is saved (:func:`outputs_guarded`): an anchored
hidden state would live until backward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

MESSAGE = (
    "tile_pass: a second derivative through the tiled loss was requested (backward with "
    "create_graph=True: gradgradcheck, a gradient penalty, a Hessian-vector product). The tiled "
    "loss gives exact first derivatives only. For higher-order derivatives compute this loss "
    "untiled: F.cross_entropy(F.linear(hidden, weight), target) in eager code, outside "
    "tile_pass.linear_cross_entropy and outside a tile_pass-compiled function."
)


def refuse_higher_order() -> None:
    """Raise where a second derivative is asked for: a backward runs with grad mode on only
    under ``create_graph=True``."""
    if torch.is_grad_enabled():
        raise RuntimeError(MESSAGE)


class _FirstOrderOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value):
        # a copy, not a view: callers scale a loss in place (Trainer's ``loss /= steps``); the
        # guarded outputs are losses and per-token values, never [N, V] rows
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        # Glue, not a gradient formula: the identity's own derivative (the gradient passes
        # through unchanged); it exists to refuse a create_graph request, eagerly, first.
        refuse_higher_order()
        return grad


def guard_outputs(compiled: Callable, positions: Sequence[int]) -> Callable:
    """``compiled`` with its outputs at ``positions`` refusing a second derivative (see above)."""
    positions = frozenset(positions)

    def run(*args):
        outputs = compiled(*args)
        guarded = [
            _FirstOrderOnly.apply(out)
            if i in positions and isinstance(out, torch.Tensor) and out.requires_grad
            else out
            for i, out in enumerate(outputs)
        ]
        return type(outputs)(guarded) if isinstance(outputs, tuple) else guarded

    return run


def region_outputs(gm: torch.fx.GraphModule, is_region: Callable[[torch.fx.Node], bool]) -> list[int]:
    """Positions of ``gm``'s outputs computed from a node ``is_region`` accepts."""
    tainted: set[torch.fx.Node] = set()
    output = None
    for node in gm.graph.nodes:
        if node.op == "output":
            output = node
        elif is_region(node) or any(arg in tainted for arg in node.all_input_nodes):
            tainted.add(node)
    values = output.args[0] if output is not None else ()
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [i for i, value in enumerate(values) if isinstance(value, torch.fx.Node) and value in tainted]


_local = threading.local()


@contextlib.contextmanager
def outputs_guarded() -> Iterator[None]:
    """While tile_pass's backend compiles a graph whose outputs it guards (no anchors needed)."""
    outer = getattr(_local, "guarded", False)
    _local.guarded = True
    try:
        yield
    finally:
        _local.guarded = outer


def anchors(*inputs: torch.Tensor | None) -> list[torch.Tensor]:
    """The inputs a scalar-loss op saves only to keep a compiled backward connected (see above):
    none eagerly (the Python check runs) or under tile_pass's backend."""
    if getattr(_local, "guarded", False):
        return []
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and is_fake(t)]


@torch.library.custom_op("tile_pass::chain_rule", mutates_args=())
def _chain_rule(
    grads: list[torch.Tensor], upstream: torch.Tensor, anchors: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [(g * upstream).to(g.dtype) for g in grads]


@_chain_rule.register_fake
def _(grads, upstream, anchors):
    return [g.new_empty(g.shape) for g in grads]


def scaled_by_upstream(saved: Sequence[torch.Tensor], upstream: torch.Tensor, need, anchors) -> list:
    """Gradients formed in forward at unit upstream gradient, times the incoming scalar one
    (the chain rule for a scalar loss), in their own dtypes; None where not needed."""
    refuse_higher_order()
    wanted = [g for g, n in zip(saved, need, strict=True) if n]
    if anchors and wanted:  # opaque, so the anchors stay saved (see the module docstring)
        scaled = iter(_chain_rule(wanted, upstream, list(anchors)))
    else:  # plain aten: a compiler may scale a saved gradient in place, in its last use
        scaled = iter([(g * upstream).to(g.dtype) for g in wanted])
    return [next(scaled) if n else None for n in need]
