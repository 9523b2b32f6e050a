"""The functional API's region: the textbook loss code, traced and rewritten by the pass.

:func:`tile_pass.linear_cross_entropy` does not carry a tile loop of its own. For each set of
options it writes the code a user would write (``F.cross_entropy(F.linear(h, w, b).float(),
y, ...)``), traces it with ``torch.fx.symbolic_trace``, gives its nodes fake example values,
and lets the backend's own rewrite (:func:`tile_pass.rewrite.rewrite_graph`) replace it with
the tiled region, exactly as it would in a user's compiled model: one matcher, one program,
one tile loop. The rewritten graph is then called like a function. A vocabulary-sharded head
is the same code, traced on the whole head's shapes, its weight marked with this rank's shard
(``tile_pass._distributed.local_head`` says why) and called with this rank's rows.

Inside ``torch.compile`` the graph is found by a key that
:func:`torch.compiler.assume_constant_result` computes while Dynamo traces (the options are
Python constants), and Dynamo inlines the graph's code, so ``fullgraph=True`` and
``dynamic=True`` hold: the graph has no shapes in it, only ops. (The options are passed to
it field by field, the :class:`~tile_pass.TileOptions` as a tuple of its values: Dynamo 2.13
rebuilds a named tuple or a frozen dataclass argument of an ``assume_constant_result``
function without its fields.)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _force_skip_lazy_graph_module

from tile_pass._caches import BoundedCache
from tile_pass._options import FIELDS, TileOptions
from tile_pass.rewrite import programs_called, rewrite_graph


class Options(NamedTuple):
    """Everything that shapes the textbook code and its plan; the graph's cache key (a named
    tuple: Dynamo passes it to :func:`graph_key` as a constant)."""

    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    device: str
    has_bias: bool
    class_weights: bool
    soft_targets: bool
    upcast: bool
    logit_scale: float | None
    softcap: float | None
    ignore_index: int
    label_smoothing: float
    reduction: str
    #: the tiles' :class:`~tile_pass.TileOptions`, resolved, as :func:`constant_tiling` gives it
    tiling: tuple
    #: a vocabulary-sharded head: ``(process group name, this rank's first row, its rows)``
    #: (``tile_pass._distributed.local_head``); ``vocab_size`` is then the whole head's
    vocab_shard: tuple[str, int, int] | None = None
    #: class probabilities of another dtype than the loss's (eager promotes the loss to theirs)
    target_dtype: torch.dtype | None = None
    #: class probabilities that require grad: differentiated in the tiles, as eager does
    target_grad: bool = False


def constant_tiling(tiling: TileOptions) -> tuple:
    """``tiling``'s values in field order, as Python constants (each specialised if Dynamo made it
    symbolic): :class:`Options`'s ``tiling``."""
    return tuple(_constant(getattr(tiling, name)) for name in FIELDS)


def _constant(value):
    if value is None or isinstance(value, (bool, torch.SymBool)):
        return None if value is None else bool(value)
    return operator.index(value)


def _textbook_code(options: Options):
    """The loss as a user writes it, for ``options`` (flat ``[N, H]`` hidden states), with the
    arguments it takes: ``(hidden, weight, [bias], target, [class_weights])``."""
    scale, cap = options.logit_scale, options.softcap
    kwargs = dict(
        reduction=options.reduction,
        ignore_index=options.ignore_index,
        label_smoothing=options.label_smoothing,
    )

    def loss(hidden, weight, bias, target, class_weights):
        logits = F.linear(hidden, weight, bias)
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if options.upcast:
            logits = logits.float()
        return (F.cross_entropy(logits, target, weight=class_weights, **kwargs),)

    if options.has_bias and options.class_weights:
        return loss
    if options.has_bias:
        return lambda hidden, weight, bias, target: loss(hidden, weight, bias, target, None)
    if options.class_weights:
        return lambda hidden, weight, target, class_weights: loss(hidden, weight, None, target, class_weights)
    return lambda hidden, weight, target: loss(hidden, weight, None, target, None)


class _ExampleValues(torch.fx.Interpreter):
    """Runs the graph on fake tensors and records each value as Dynamo does
    (``node.meta["example_value"]``, ``requires_grad`` included), which the matcher reads."""

    def run_node(self, node):
        value = super().run_node(node)
        if isinstance(value, torch.Tensor):
            node.meta["example_value"] = value
        return value


def _examples(options: Options, mode: FakeTensorMode) -> list:
    tokens, vocab, hidden_size = 8, options.vocab_size, options.hidden_size
    loss_dtype = torch.float32 if options.upcast else options.dtype
    with mode:
        device = torch.device(options.device)
        examples = [
            torch.empty(tokens, hidden_size, dtype=options.dtype, device=device, requires_grad=True),
            torch.empty(vocab, hidden_size, dtype=options.dtype, device=device, requires_grad=True),
        ]
        if options.has_bias:
            examples.append(torch.empty(vocab, dtype=options.dtype, device=device, requires_grad=True))
        if options.soft_targets:
            examples.append(
                torch.empty(
                    tokens,
                    vocab,
                    dtype=options.target_dtype or loss_dtype,
                    device=device,
                    requires_grad=options.target_grad,
                )  # fmt: skip
            )
        else:
            examples.append(torch.zeros(tokens, dtype=torch.long, device=device))
        if options.class_weights:
            examples.append(torch.empty(vocab, dtype=loss_dtype, device=device))
    return examples


def _build(options: Options) -> torch.fx.GraphModule:
    with _force_skip_lazy_graph_module():  # Dynamo does not trace a lazy module's first call
        gm = torch.fx.symbolic_trace(_textbook_code(options))
        mode = FakeTensorMode()
        examples = _examples(options, mode)
        with mode:  # its own mode, also where the caller runs under another (a fake-tensor trace)
            _ExampleValues(gm).run(*examples)
        if options.vocab_shard is not None:  # the whole head's shapes; this rank's rows at run time
            from tile_pass._distributed import VOCAB_SHARD_META

            weight = [node for node in gm.graph.nodes if node.op == "placeholder"][1]
            weight.meta[VOCAB_SHARD_META] = options.vocab_shard
        tiling = dataclasses.replace(TileOptions(*options.tiling), strict=True)
        result = rewrite_graph(gm, tiling)
        if len(result.report.rewrites) != 1:
            reasons = "; ".join(s.reason for s in result.report.skipped) or "no region found"
            raise RuntimeError(f"tile_pass: internal error: the textbook loss was not rewritten ({reasons})")
        graph = torch.fx.GraphModule(gm, gm.graph)
        graph.programs = programs_called(graph.graph)  # found by their keys while the graph lives
        return graph


#: Rewritten textbook graphs kept at once (one per set of options; rebuilt when evicted).
TEXTBOOK_CACHE_SIZE = 64
_graphs = BoundedCache("textbook graphs", TEXTBOOK_CACHE_SIZE)


@torch.compiler.assume_constant_result
def graph_key(*fields) -> str:
    """The key of the options ``fields``' rewritten graph in :data:`_graphs`, built there if
    missing (the fields one by one: Dynamo converts each constant, not a tuple class)."""
    options = Options(*fields)
    key = repr(options)
    if _graphs.get(key) is None:
        _graphs.put(key, _build(options))
    return key


def run(options: Options, hidden, weight, bias, target, class_weights) -> torch.Tensor:
    """The tiled loss of ``options`` on flat ``[N, H]`` hidden states and ``[N]`` targets."""
    inputs = [hidden, weight] + ([bias] if options.has_bias else []) + [target]
    inputs += [class_weights] if options.class_weights else []
    return _graphs[graph_key(*options)](*inputs)[0]
