"""Find ``linear -> [row-wise ops] -> cross_entropy`` regions in a Dynamo graph and rewrite them.

The graph is Dynamo's torch-level FX graph: ``torch._C._nn.linear`` / ``matmul`` nodes,
``call_method`` views and casts, one ``F.cross_entropy`` (or ``log_softmax`` +
``nll_loss``) call. Every node carries ``meta["example_value"]`` (a fake tensor, possibly
with symbolic sizes), which is how a match is proven exact: shapes, dtypes and consumers
are checked on it, and anything unproven leaves the region untouched with a reason a user
can act on.

Between the projection and the loss, every op must act on each token's row of logits
independently; then it can run inside each tile:

* views (``view``/``reshape``/``flatten``/``contiguous``) only regroup rows: dropped;
* slices of leading (token) dimensions (``logits[..., :-1, :]``) select rows: applied to
  the hidden states instead;
* casts to float32, ``tanh``, and ``* / + -`` with a constant or a ``[V]``/0-d tensor
  (soft-capping, logit scales, a bias added after the linear): replayed in each tile.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11/2.12: the same unguarded hint, under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

from tile_pass import _region_match, _weight_grad
from tile_pass._fold_loops import fold_row_loops
from tile_pass._fx import as_linear as _as_linear
from tile_pass._fx import leading_index as _leading_index
from tile_pass._fx import same as _same
from tile_pass._fx import val as _val
from tile_pass._logging import log
from tile_pass._rules import NoMatch, bind
from tile_pass._tile_kernel import encode_head_spec
from tile_pass._tiling import auto_tile, choose_tile_tokens, effective_tile, tile_bytes_per_token
from tile_pass.report import GraphReport, Rewrite, Skip, source_line
from tile_pass.tiled_loss import tiled_region_loss

_VIEW_METHODS = {"view", "reshape", "flatten"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten}
_CAST_METHODS = {"float", "to", "type"}
_BINARY = {
    operator.mul: "mul", torch.mul: "mul", "mul": "mul", "__mul__": "mul",
    operator.truediv: "div", torch.div: "div", torch.true_divide: "div", "div": "div",
    "__truediv__": "div", "true_divide": "div",
    operator.add: "add", torch.add: "add", "add": "add", "__add__": "add",
    operator.sub: "sub", torch.sub: "sub", "sub": "sub", "__sub__": "sub",
}  # fmt: skip
_COMMUTATIVE = {"mul", "add"}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_NLL_SIGNATURE = inspect.signature(F.nll_loss)
_LOG_SOFTMAX_SIGNATURE = inspect.signature(F.log_softmax)


_NoMatch = NoMatch


@dataclass
class Region:
    """One matched region, with everything the rewrite needs."""

    loss: torch.fx.Node
    erase: list[torch.fx.Node]  # the loss-side nodes the tiled loss replaces (log_softmax)
    linear: torch.fx.Node
    hidden: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    target: torch.fx.Node
    chain: list[torch.fx.Node]  # projection output .. loss input, in order
    slices: list[tuple]  # leading-dim indices, applied to the hidden states
    ops: list[list]  # LossHead ops
    constants: list[float]  # the numbers the ops refer to
    class_weight: int | None  # index of the loss's class weights in ``extras``
    soft_targets: bool  # the target holds class probabilities [tokens, vocab]
    extras: list[torch.fx.Node]
    upcast: bool
    returned: torch.fx.Node | None  # a chain node that is also a graph output
    returned_same_shape: bool  # ... reached from the projection by row-wise ops only
    transpose: torch.fx.Node | None
    autocast_dtype: torch.dtype | None  # the projection ran under autocast in this dtype
    num_tokens: int | torch.SymInt
    returned_ops: int  # how many of ``ops`` come before the returned node
    ignore_index: int
    reduction: str
    label_smoothing: float
    form: str


@dataclass
class ReturnedLogits:
    """How to rebuild a graph output that the rewrite detached or dropped (see backend)."""

    output_index: int
    extra_outputs: list[int]  # positions in the extra outputs: hidden, weight, bias, operands
    prefix: torch.fx.GraphModule | None  # (hidden, weight, bias?, *operands) -> logits; exact
    vocab_size: int | None = None  # dropped: placeholder shape [*hidden.shape[:-1], V]
    dtype: torch.dtype | None = None
    has_bias: bool = False


@dataclass
class GraphRewrite:
    """The result of rewriting one graph: the report, and outputs the backend must rebuild."""

    report: GraphReport
    num_outputs: int = 0
    returned_logits: list[ReturnedLogits] = field(default_factory=list)
    #: the graph as Dynamo gave it, to fall back on if the rewritten one does not compile
    original_graph: torch.fx.Graph | None = None


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _describe(node: torch.fx.Node) -> str:
    if node.op == "output":
        return "the graph output (the function returns them)"
    return f"`{_name(node)}` at {source_line(node)}"


def _loss_options(loss: torch.fx.Node) -> tuple[dict, list[torch.fx.Node], list[list]]:
    """Normalised options of a cross_entropy (or log_softmax + nll_loss) node.

    Returns the options, the extra nodes to erase, and ops to append (a log_softmax upcast).
    """
    if loss.target is F.cross_entropy:
        options = bind(_CE_SIGNATURE, loss)
        return options, [], []
    options = bind(_NLL_SIGNATURE, loss)
    log_probs = options["input"]
    if not (
        isinstance(log_probs, torch.fx.Node)
        and log_probs.op in ("call_function", "call_method")
        and log_probs.target in (F.log_softmax, torch.log_softmax, "log_softmax")
    ):
        raise _NoMatch(f"nll_loss's input comes from {_describe(log_probs)}, not from log_softmax")
    ls_options = bind(_LOG_SOFTMAX_SIGNATURE, log_probs)
    log_probs_val, dim = _val(log_probs), ls_options["dim"]
    if log_probs_val is None or not isinstance(dim, int) or dim % log_probs_val.dim() != 1:
        raise _NoMatch("log_softmax is not taken over the vocabulary dimension of [tokens, vocab]")
    extra_ops = []
    dtype = ls_options.get("dtype")
    if dtype is not None:
        if dtype != torch.float32:
            raise _NoMatch(f"log_softmax computes in {dtype}; only a float32 upcast is tiled")
        extra_ops.append(["cast", "float32"])
    users = [u for u in log_probs.users if u is not loss]
    if users:
        raise _NoMatch(
            f"the log-probabilities are also consumed by {', '.join(_describe(u) for u in users)}, "
            "so they must exist whole"
        )
    options = dict(options, input=ls_options["input"], label_smoothing=0.0)
    return options, [log_probs], extra_ops


def _class_weights(weight, vocab) -> torch.fx.Node | None:
    """The loss's ``weight=`` node, if it is a class-weight vector the tiles can take."""
    if weight is None:
        return None
    weight_val = _val(weight)
    if weight_val is None or weight_val.dim() != 1 or not _same(weight_val.shape[0], vocab):
        raise _NoMatch("the loss's class weights (weight=) are not a [V] tensor of this graph")
    if weight_val.requires_grad:
        raise _NoMatch("the loss's class weights require grad; eager cannot differentiate them either")
    return weight


def _check_options(options: dict) -> None:
    if options.get("size_average") is not None or options.get("reduce") is not None:
        raise _NoMatch("the loss uses the deprecated size_average/reduce arguments; pass reduction=...")
    for name, kinds in (("ignore_index", int), ("reduction", str), ("label_smoothing", (int, float))):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise _NoMatch(
                f"the loss's {name} is not a compile-time constant ({value!r}); "
                "the tiled loss needs it fixed when the graph is compiled"
            )
    if options["reduction"] not in ("mean", "sum", "none"):
        raise _NoMatch(f"the loss has reduction={options['reduction']!r}")
    if not 0.0 <= options["label_smoothing"] <= 1.0:
        raise _NoMatch("label_smoothing is outside [0, 1]; eager raises for it, so it is left to eager")


def _check_cast(node: torch.fx.Node) -> None:
    """Raise unless ``node`` is a no-op cast or a float32 upcast on the same device."""
    out, inp = _val(node), _val(node.args[0])
    if out is None or inp is None:
        raise _NoMatch("a cast between the linear and the loss has no shape information")
    if out.device != inp.device:
        raise _NoMatch("the logits are moved to another device before the loss")
    if out.dtype == inp.dtype:
        return
    if out.dtype != torch.float32:
        raise _NoMatch(f"the logits are cast to {out.dtype} before the loss (only a float32 upcast is tiled)")
    if inp.dtype == torch.float64:
        raise _NoMatch("the float64 logits are cast down to float32 before the loss")


def _row_wise_op(
    node: torch.fx.Node, x: torch.fx.Node, vocab_size, extras: list[torch.fx.Node], constants: list[float]
):
    """The LossHead op for an elementwise ``node`` applied to chain tensor ``x``, else None;
    a tensor operand is added to ``extras``, a number to ``constants``."""
    if node.target in (torch.tanh, "tanh") and node.args == (x,) and not node.kwargs:
        return ["tanh"]
    kind = _BINARY.get(node.target) if node.op in ("call_function", "call_method") else None
    if kind is None or len(node.args) != 2 or node.kwargs:
        return None
    left, right = node.args
    if left is x and right is not x:
        other, reflected = right, False
    elif right is x and left is not x:
        other, reflected = left, True
    else:
        return None
    if reflected and kind not in _COMMUTATIVE:
        if kind != "sub":
            raise _NoMatch(f"`{_name(node)}` divides by the logits, which the tiled loss does not replay")
        kind = "rsub"
    if isinstance(other, bool):
        return None
    if isinstance(other, (int, float)):
        constants.append(float(other))
        return [kind, len(constants) - 1]
    other_val = other.meta.get("example_value") if isinstance(other, torch.fx.Node) else None
    if isinstance(other_val, (torch.SymInt, torch.SymFloat)):
        raise _NoMatch(
            f"`{_name(node)}` uses a dynamic scalar; mark it static or keep the scale a Python constant"
        )
    if not isinstance(other_val, torch.Tensor):
        return None
    shape = list(other_val.shape)
    row_wise = other_val.dim() == 0 or (
        all(_same(s, 1) for s in shape[:-1]) and (_same(shape[-1], 1) or _same(shape[-1], vocab_size))
    )
    if not row_wise:
        raise _NoMatch(
            f"`{_name(node)}` combines the logits with a tensor of shape {tuple(shape)} that differs "
            "per token, so it cannot be replayed tile by tile"
        )
    if other_val.requires_grad:
        raise _NoMatch(
            f"`{_name(node)}` uses a learnable tensor; learnable logit scales/biases are not tiled yet"
        )
    if other not in extras:
        extras.append(other)
    return [kind + "_t", extras.index(other)]


def _chain_operand(node: torch.fx.Node) -> torch.fx.Node:
    """The input of ``node`` that carries the logits (the other operand of a binary op is not)."""
    if node.target not in _BINARY:
        return node.args[0]
    out = _val(node)
    candidates = [
        a for a in node.args
        if isinstance(a, torch.fx.Node) and _val(a) is not None and tuple(_val(a).shape) == tuple(out.shape)
    ]  # fmt: skip
    if len(candidates) != 1:
        raise _NoMatch(
            f"the loss input comes from {_describe(node)}, which combines two logits-sized tensors"
        )
    return candidates[0]


def match_region(loss: torch.fx.Node) -> Region:
    """The region ending at loss node ``loss``; raises ``_NoMatch`` with a reason."""
    options, erase, tail_ops = _loss_options(loss)
    _check_options(options)
    logits, target = options["input"], options["target"]
    logits_val, target_val = _val(logits), _val(target)
    if logits_val is None or target_val is None:
        raise _NoMatch("the loss inputs carry no shape information")
    if logits_val.dim() != 2:
        raise _NoMatch(
            f"the loss input is {logits_val.dim()}-D; only [tokens, vocab] logits are tiled "
            "(flatten with .view(-1, V) before the loss)"
        )
    soft_targets = target_val.is_floating_point()
    if soft_targets:
        if erase:
            raise _NoMatch("nll_loss takes class indices, not class probabilities")
        if tuple(target_val.shape) != tuple(logits_val.shape) and not all(
            _same(a, b) for a, b in zip(target_val.shape, logits_val.shape, strict=False)
        ):
            raise _NoMatch("the class-probability target does not have the logits' [tokens, vocab] shape")
        if target_val.dim() != 2:
            raise _NoMatch("the class-probability target is not [tokens, vocab]")
    elif target_val.dtype != torch.int64:
        raise _NoMatch(f"the target dtype is {target_val.dtype}; eager cross_entropy expects int64")
    elif target_val.dim() != 1 or not _same(target_val.shape[0], logits_val.shape[0]):
        raise _NoMatch("the target shape does not match the logits' token count")
    class_weight = _class_weights(options["weight"], logits_val.shape[-1])
    vocab = logits_val.shape[-1]

    chain: list[torch.fx.Node] = []  # loss input back to (excluding) the projection
    node = logits
    while True:
        if not isinstance(node, torch.fx.Node):
            raise _NoMatch("the loss input is not computed in this graph")
        linear = _as_linear(node)
        if linear is not None:
            break
        if node.op == "placeholder":
            raise _NoMatch(
                "the logits are an input of this graph: a graph break separates the LM head from "
                "the loss, so the pass sees only one half. Find the break with "
                'TORCH_LOGS="graph_breaks" and remove it (e.g. a print or logging call between '
                "the head and the loss), or compute the loss in the function that calls the head"
            )
        if node.op not in ("call_function", "call_method") or not node.args:
            raise _NoMatch(f"the loss input comes from {_describe(node)}, not from a linear layer")
        value = _val(node)
        if value is None or not _same(value.shape[-1], vocab):
            raise _NoMatch(f"{_describe(node)} changes the vocabulary dimension of the logits")
        chain.append(node)
        node = _chain_operand(node)
    chain.reverse()
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
    if not linear_val.is_floating_point():
        raise _NoMatch("the logits are not floating point")
    input_dtypes = {hidden_val.dtype, weight_val.dtype} | (
        {bias_val.dtype} if bias_val is not None else set()
    )
    autocast_dtype = None
    if input_dtypes != {linear_val.dtype}:
        # F.linear only accepts mixed or other dtypes under autocast, which casts its inputs
        # to the autocast dtype: the rewrite makes those casts explicit.
        if linear_val.dtype not in (torch.bfloat16, torch.float16):
            raise _NoMatch(f"the linear's output dtype {linear_val.dtype} does not follow from its inputs")
        autocast_dtype = linear_val.dtype

    # classify every op between the projection and the loss
    ops: list[list] = []
    slices: list[tuple] = []
    extras: list[torch.fx.Node] = []
    constants: list[float] = []
    steps = [head_form if autocast_dtype is None else f"autocast({str(autocast_dtype)[6:]}) {head_form}"]
    regrouped = False  # a view has mixed leading dims: later slices cannot move to the hidden
    row_wise_only = [True]  # per chain position: reached from the projection by row-wise ops only
    ops_before = [0]  # per chain position: LossHead ops emitted up to and including it
    previous = node
    for current in chain:
        value = _val(current)
        if current.op == "call_method" and current.target == "contiguous":
            steps.append("contiguous")
        elif _no_op_redistribute(current, previous):  # ColwiseParallel's output hook, Shard(-1) kept
            steps.append("redistribute (no-op)")
        elif (current.op == "call_method" and current.target in _VIEW_METHODS) or (
            current.op == "call_function" and current.target in _VIEW_FUNCTIONS
        ):
            regrouped = True
            steps.append(str(getattr(current.target, "__name__", current.target)))
        elif (index := _leading_index(current, _val(previous).dim())) is not None:
            if regrouped:
                raise _NoMatch("the logits are sliced after being reshaped; slice before flattening")
            slices.append(index)
            steps.append("slice tokens")
        elif current.op == "call_method" and current.target in _CAST_METHODS:
            _check_cast(current)
            if value.dtype != _val(previous).dtype:
                ops.append(["cast", "float32"])
                steps.append("float32 upcast")
        elif (op := _row_wise_op(current, previous, vocab_size, extras, constants)) is not None:
            if value.dtype != _val(previous).dtype or tuple(value.shape) != tuple(_val(previous).shape):
                raise _NoMatch(f"{_describe(current)} changes the logits' dtype or shape")
            ops.append(op)
            operand = op[1:] and (op[1] if op[0].endswith("_t") else constants[op[1]])
            steps.append(f"{op[0]}({operand})" if len(op) > 1 else op[0])
        else:
            raise _NoMatch(
                f"the loss input comes from {_describe(current)}, which the tiled loss does not replay"
            )
        row_wise_only.append(row_wise_only[-1] and not slices and not regrouped)
        ops_before.append(len(ops))
        previous = current
    ops += tail_ops
    loss_val = _val(loss)
    expected = torch.float32 if tail_ops else _val(previous).dtype
    if loss_val is not None and loss_val.dtype != expected:
        if loss_val.dtype != torch.float32:
            raise _NoMatch(f"the loss computes in {loss_val.dtype}, not in its input's dtype")
        ops.append(["cast", "float32"])  # autocast runs the loss in float32
        steps.append("float32 (autocast)")
        cast_by_autocast = [n for n in (class_weight, target if soft_targets else None) if n is not None]
        if any(_val(n).dtype != torch.float32 for n in cast_by_autocast):
            raise _NoMatch(
                "autocast casts the loss's class weights or probability targets to float32 as well; "
                "that is not replayed yet (make them float32)"
            )
    if class_weight is not None:
        extras.append(class_weight)
    steps.append(
        ("log_softmax + nll_loss" if erase else "cross_entropy")
        + f"(reduction={options['reduction']}"
        + ("" if soft_targets else f", ignore_index={options['ignore_index']}")
        + (f", label_smoothing={options['label_smoothing']}" if options["label_smoothing"] else "")
        + (", class weights" if class_weight is not None else "")
        + (", class probabilities" if soft_targets else "")
        + ")"
    )

    # consumers: each node feeds the next; one of them may also be returned
    path = [node, *chain]
    returned = None
    returned_same_shape = False
    returned_ops = 0
    for position, (producer, consumer) in enumerate(zip(path, [*chain, *(erase or [loss])], strict=True)):
        others = [u for u in producer.users if u is not consumer]
        if others and all(u.op == "output" for u in others) and returned is None:
            returned, returned_same_shape = producer, row_wise_only[position]
            returned_ops = ops_before[position]
            continue
        if others:
            raise _NoMatch(
                f"the logits are also consumed by {', '.join(_describe(u) for u in others)}, so they "
                "must exist whole; compute that from the loss or drop it to get the tiled loss"
            )
    return Region(
        loss=loss,
        erase=erase,
        linear=node,
        hidden=hidden,
        weight=weight,
        bias=bias,
        target=target,
        chain=chain,
        slices=slices,
        ops=ops,
        constants=constants,
        class_weight=None if class_weight is None else extras.index(class_weight),
        soft_targets=soft_targets,
        extras=extras,
        upcast=any(op[0] == "cast" for op in ops) or linear_val.dtype == torch.float32,
        returned=returned,
        returned_same_shape=returned_same_shape,
        transpose=transpose,
        autocast_dtype=autocast_dtype,
        num_tokens=logits_val.shape[0],
        returned_ops=returned_ops,
        ignore_index=options["ignore_index"],
        reduction=options["reduction"],
        label_smoothing=float(options["label_smoothing"]),
        form=" -> ".join(steps),
    )


def _no_op_redistribute(node: torch.fx.Node, previous: torch.fx.Node) -> bool:
    """``x.redistribute(...)`` of a DTensor that keeps its mesh and placements."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op not in ("call_method", "call_function") or name not in ("redistribute", "prim_redistribute"):
        return False  # torch 2.11's Dynamo records the call as the function ``prim_redistribute``
    out, inp = _val(node), _val(previous)
    placements = [getattr(v, "placements", None) for v in (out, inp)]
    meshes = [getattr(v, "device_mesh", None) for v in (out, inp)]
    return placements[0] is not None and placements[0] == placements[1] and meshes[0] == meshes[1]


def _tensor_parallel(region: Region) -> tuple[int, int, int] | None:
    """``(degree, first row, rows)`` of this rank's vocabulary shard, for a DTensor head that
    ``tile_pass.vocab_parallel`` tiles; None for a plain head; ``_NoMatch`` for what it cannot."""
    weight = _val(region.weight)
    placements = getattr(weight, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(placements) != (Shard(0),):
        raise _NoMatch(
            f"the DTensor LM head is placed {tuple(placements)} on a {mesh.ndim}-D mesh; only a "
            "vocabulary-sharded head (Shard(0)) on a 1-D tensor-parallel mesh is tiled"
        )
    unsupported = [
        what for what, present in (
            ("row-wise ops between the head and the loss", any(op[0] != "cast" for op in region.ops)),
            ("class weights or probability targets", region.class_weight is not None or region.soft_targets),
            ("a projection bias", region.bias is not None), ("returned logits", region.returned is not None),
            ("reduction='none'", region.reduction == "none"), ("token slices", bool(region.slices)),
            ("autocast", region.autocast_dtype is not None),
        ) if present
    ]  # fmt: skip
    if unsupported:
        raise _NoMatch(f"the vocabulary-sharded head has {', '.join(unsupported)}, which are not tiled in "
                       "tensor-parallel form yet")  # fmt: skip
    from tile_pass.vocab_parallel import shard_rows

    start, rows = shard_rows(int(weight.shape[0]), mesh.size(), mesh.get_local_rank())
    return mesh.size(), start, rows


def _tensor_parallel_text(tensor_parallel: tuple[int, int, int] | None) -> str:
    if tensor_parallel is None:
        return ""
    degree, start, rows = tensor_parallel
    last = start + rows - 1
    return f" [tensor-parallel: degree {degree}, this rank's vocabulary rows {start}..{last}; bytes per rank]"


def _is_loss(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.cross_entropy, F.nll_loss)


def _prefix_module(region: Region, inputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A GraphModule computing the returned logits from ``inputs``, copied from the region."""
    graph = torch.fx.Graph()
    env = {node: graph.placeholder(f"input_{i}") for i, node in enumerate(inputs)}
    end = region.chain.index(region.returned) + 1 if region.returned in region.chain else 0
    for node in [region.transpose, region.linear, *region.chain[:end]]:
        if node is not None:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[region.returned])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _prefix_inputs(region: Region) -> list[torch.fx.Node]:
    """Every node the returned logits depend on from outside the region: hidden, weight, ..."""
    inside = {region.transpose, region.linear, *region.chain}
    end = region.chain.index(region.returned) + 1 if region.returned in region.chain else 0
    inputs = [region.hidden, region.weight] + ([region.bias] if region.bias is not None else [])
    for node in [region.transpose, region.linear, *region.chain[:end]]:
        if node is not None:
            inputs += [n for n in node.all_input_nodes if n not in inputs and n not in inside]
    return inputs


def _autocast_inputs(
    graph: torch.fx.Graph, region: Region, inputs: list[torch.fx.Node], before: torch.fx.Node
) -> list[torch.fx.Node]:
    """The prefix's inputs as the projection saw them: under autocast, hidden, weight and bias
    cast to the autocast dtype (as autocast casts F.linear's inputs), so that the replay of the
    returned logits' gradient path, which runs outside autocast, computes in that dtype and
    its gradient flows back through the casts to the float32 parameters."""
    if region.autocast_dtype is None:
        return inputs
    projection_inputs = 3 if region.bias is not None else 2
    with graph.inserting_before(before):
        cast = [graph.call_method("to", (node, region.autocast_dtype)) for node in inputs[:projection_inputs]]
    return cast + inputs[projection_inputs:]


def _unflatten_tokens(logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``[N, V] -> [*hidden.shape[:-1], V]``: the shape the projection gave the logits."""
    return logits.view(*hidden.shape[:-1], logits.shape[-1])


def _rewrite(
    graph: torch.fx.Graph, region: Region, tile_tokens: int, drop_logits: bool, compile_tiles: bool, result
) -> str:
    """Apply one rewrite; return how a returned logits output was handled."""
    loss = region.loss
    returned = region.returned
    drop = returned is not None and drop_logits and region.returned_same_shape
    # the tiles also write the returned logits: one GEMM for both (mean/sum, same shape)
    from_tiles = (
        returned is not None
        and not drop
        and region.returned_same_shape
        and not region.slices  # the tiles cover the loss's rows, which must be all of them
        and region.reduction != "none"
    )
    tensor_parallel = _tensor_parallel(region)
    if tensor_parallel is not None:
        from tile_pass.vocab_parallel import vocab_parallel_region_loss

        with graph.inserting_before(loss):
            new_loss = graph.call_function(
                vocab_parallel_region_loss,
                (region.hidden, region.weight, region.target),
                {"reduction": region.reduction, "ignore_index": region.ignore_index,
                 "label_smoothing": region.label_smoothing, "upcast": region.upcast and bool(region.ops),
                 "tile_tokens": tile_tokens, "compile_tiles": compile_tiles,
                 "group_name": _val(region.weight).device_mesh.get_group().group_name,
                 "vocab_start": tensor_parallel[1]},
            )  # fmt: skip
        new_loss.meta.update(loss.meta)
        loss.replace_all_uses_with(new_loss)
        graph.erase_node(loss)
        for node in [*region.erase, *reversed(region.chain), region.linear, region.transpose]:
            if node is not None and not node.users:
                graph.erase_node(node)
        return "not returned"
    with graph.inserting_before(loss):
        hidden, weight, bias = region.hidden, region.weight, region.bias
        for index in region.slices:
            hidden = graph.call_function(operator.getitem, (hidden, index))
        if region.autocast_dtype is not None:  # what autocast does to F.linear's inputs
            hidden, weight = (graph.call_method("to", (t, region.autocast_dtype)) for t in (hidden, weight))
            if bias is not None:
                bias = graph.call_method("to", (bias, region.autocast_dtype))
        tiled = graph.call_function(
            tiled_region_loss,
            (hidden, weight, bias, region.target, list(region.extras)),
            {
                "head_spec": encode_head_spec(region.ops, region.class_weight, region.soft_targets),
                "constants": tuple(region.constants),
                "ignore_index": region.ignore_index,
                "reduction": region.reduction,
                "label_smoothing": region.label_smoothing,
                "tile_tokens": tile_tokens,
                "keep_logits_after": region.returned_ops if from_tiles else -1,
                "compile_tiles": compile_tiles,
            },
        )
        new_loss, tiled_logits = tiled, None
        if from_tiles:
            new_loss = graph.call_function(operator.getitem, (tiled, 0))
            flat = graph.call_function(operator.getitem, (tiled, 1))
            tiled_logits = graph.call_function(_unflatten_tokens, (flat, region.hidden))
            tiled_logits.meta.update(returned.meta)
    new_loss.meta.update(loss.meta)
    loss.replace_all_uses_with(new_loss)
    graph.erase_node(loss)
    for node in region.erase:
        graph.erase_node(node)

    handled = "not returned"
    if returned is not None:
        output = next(n for n in graph.nodes if n.op == "output")
        outputs = list(output.args[0])
        if result.num_outputs == 0:
            result.num_outputs = len(outputs)
        position = outputs.index(returned)
        extra_base = len(outputs) - result.num_outputs
        if drop:
            outputs[position] = None
            record = ReturnedLogits(
                position, [extra_base], None, _val(region.weight).shape[0], _val(returned).dtype
            )
            outputs.append(region.hidden)
            handled = "dropped (drop_logits=True): a zero-byte NaN placeholder is returned"
        else:
            if tiled_logits is None:
                with graph.inserting_after(returned):
                    tiled_logits = graph.call_method("detach", (returned,))
                tiled_logits.meta.update(returned.meta)
            outputs[position] = tiled_logits
            inputs = _prefix_inputs(region)
            record = ReturnedLogits(
                position, list(range(extra_base, extra_base + len(inputs))), _prefix_module(region, inputs)
            )
            outputs += _autocast_inputs(graph, region, inputs, output)
            handled = (
                "returned exactly"
                + (", written by the tiles (no extra GEMM)" if from_tiles else "")
                + ": kept in the model dtype, no float32 upcast, no saved softmax, "
                "and its gradient is computed only if the caller uses it"
            )
        result.returned_logits.append(record)
        output.args = (tuple(outputs),)
    for node in [*reversed(region.chain), region.linear, region.transpose]:
        if node is not None and not node.users:
            graph.erase_node(node)
    return handled


def rewrite_graph(
    gm: torch.fx.GraphModule,
    *,
    graph_index: int = 0,
    tile_tokens: int | None = None,
    tile_bytes: int | None = None,
    drop_logits: bool = False,
    compile_tiles: bool = False,
    run_compiled_tiles: bool | None = None,
    strict: bool = False,
) -> GraphRewrite:
    """Rewrite every exactly-matched region of ``gm`` in place; report every candidate.

    ``compile_tiles`` is the plan (tile sizes follow its byte model, the report says it);
    ``run_compiled_tiles`` (default: the same) is what the rewritten graph runs, which
    ``explain`` sets to False to stay quick without changing the plan it reports.

    The pass is only an optimisation, so it must never be why a training run dies: an error
    other than a deliberate no-match, raised while matching, planning or rewriting a region,
    puts back the graph as Dynamo gave it (every region of it), logs a WARNING naming the
    error and the region's lines, and is reported as a skip ("internal error: ..."). With
    ``strict`` (the project's own tests, ``TILE_PASS_STRICT=1``) it is raised instead."""
    run_compiled_tiles = compile_tiles if run_compiled_tiles is None else run_compiled_tiles
    pristine = _copy_graph(gm.graph)
    region: list[torch.fx.Node] = []  # the nodes of the region being rewritten, for the report
    try:
        # per-row loops (TRL's selective_log_softmax) folded into one row-wise op, kept only if
        # that lets the pass tile a region; else the regions are found again in Dynamo's graph
        if fold_row_loops(gm):
            result = _rewrite_regions(gm, graph_index, tile_tokens, tile_bytes, drop_logits, compile_tiles,
                                      run_compiled_tiles, region)  # fmt: skip
            if result.report.rewrites:
                result.original_graph = pristine
                return result
            gm.graph = _copy_graph(pristine)
            gm.recompile()
        result = _rewrite_regions(gm, graph_index, tile_tokens, tile_bytes, drop_logits, compile_tiles,
                                  run_compiled_tiles, region)  # fmt: skip
        result.original_graph = pristine
        return result
    except Exception as error:
        if strict:
            raise
        gm.graph = pristine
        gm.recompile()
        lines = "; ".join(dict.fromkeys(source_line(node) for node in region)) or "?"
        log.warning(
            "tile_pass: internal error while rewriting the region at %s; graph %d is left as Dynamo gave "
            "it and runs untiled (TILE_PASS_STRICT=1 raises instead)", lines, graph_index, exc_info=True,
        )  # fmt: skip
        return GraphRewrite(
            GraphReport(index=graph_index, skipped=[internal_error(graph_index, lines, error)])
        )


def internal_error(graph_index: int, lines: str, error: BaseException) -> Skip:
    """The report of a region the pass gave up on because of its own error."""
    reason = f"internal error: {type(error).__name__}: {error} (the graph was left as Dynamo gave it)"
    return Skip(graph_index, lines, reason)


def is_region_node(node: torch.fx.Node) -> bool:
    """A call the rewrite inserted, or a tile_pass op the user's code called (the functional API)."""
    if node.op != "call_function":
        return False
    from tile_pass.tiled_region import run_region
    from tile_pass.vocab_parallel import run_sharded_region, vocab_parallel_region_loss

    return node.target in (tiled_region_loss, run_region, run_sharded_region, vocab_parallel_region_loss) or (
        getattr(node.target, "namespace", None) == "tile_pass"
    )


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The nodes of ``graph`` in a new graph, what to put back: meta copied shallowly, and what
    Dynamo attaches to nodes beyond it (a placeholder's ``_dynamo_source``) carried over."""
    copy = torch.fx.Graph(tracer_cls=graph._tracer_cls)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    value, output = copy.graph_copy(graph, copies, return_output_node=True)
    copies[output] = copy.output(value, output.type)
    for node, copied in copies.items():
        copied.meta = dict(node.meta)
        for name, attribute in vars(node).items():
            vars(copied).setdefault(name, attribute)
    copy._codegen = graph._codegen
    return copy


def _rewrite_regions(
    gm, graph_index, tile_tokens, tile_bytes, drop_logits, compile_tiles, run_compiled_tiles, region
) -> GraphRewrite:
    result = GraphRewrite(GraphReport(index=graph_index))
    report = result.report
    skipped_losses: dict[torch.fx.Node, Skip] = {}
    for loss in [n for n in gm.graph.nodes if _is_loss(n)]:
        region[:] = [loss]
        try:
            matched = match_region(loss)
            tensor_parallel = _tensor_parallel(matched)
        except _NoMatch as why:
            skipped_losses[loss] = Skip(graph_index, source_line(loss), str(why))
            continue
        region[:] = [matched.linear, loss]
        vocab_size, hidden_size = _val(matched.weight).shape
        dtype = _val(matched.linear).dtype
        # the tile only affects speed, so a symbolic vocabulary is sized by its hint, unguarded
        tile = choose_tile_tokens(
            optimization_hint(vocab_size, fallback=32768), dtype, matched.upcast,
            tile_tokens=tile_tokens, tile_bytes=tile_bytes, device=_val(matched.linear).device,
            fused=compile_tiles,
        )  # fmt: skip
        if tile_tokens is None:
            tile = auto_tile(tile)
        num_tokens = matched.num_tokens
        tokens_hint = optimization_hint(num_tokens, fallback=8192)
        tile_now = effective_tile(tokens_hint, tile)
        # the weight the op differentiates is the projection's input, in the logits' dtype
        schedule = None
        if _val(matched.weight).requires_grad:
            vocab_hint = optimization_hint(vocab_size, fallback=32768)
            hidden_hint = optimization_hint(hidden_size, fallback=4096)
            tile_now, schedule = _weight_grad.plan(
                tokens_hint, tile_now, -tile if tile < 0 else None, (vocab_hint, hidden_hint),
                dtype, torch.promote_types(torch.float32, dtype),
                tile_bytes_per_token(vocab_hint, dtype, matched.upcast, compile_tiles), tokens_hint,
            )  # fmt: skip
        itemsize = dtype.itemsize
        local_vocab = tensor_parallel[2] if tensor_parallel else vocab_size
        returned_val = _val(matched.returned) if matched.returned is not None else None
        handled = _rewrite(gm.graph, matched, tile, drop_logits, run_compiled_tiles, result)
        kept = 0
        if returned_val is not None and not handled.startswith("dropped"):
            kept = returned_val.numel() * returned_val.element_size()
        report.rewrites.append(
            Rewrite(
                graph=graph_index,
                matmul_source=source_line(matched.linear),
                loss_source=source_line(loss),
                form=matched.form + _tensor_parallel_text(tensor_parallel),
                num_tokens=_plain(num_tokens),
                hidden_size=_plain(hidden_size),
                vocab_size=_plain(vocab_size),
                dtype=str(dtype).replace("torch.", ""),
                reduction=matched.reduction,
                tile_tokens=tile_now,
                num_tiles=_plain((num_tokens + tile_now - 1) // tile_now),
                forward_bytes_avoided=_plain(
                    num_tokens * local_vocab * _forward_bytes(itemsize, matched.upcast) - kept
                ),
                backward_bytes_avoided=_plain(
                    num_tokens * local_vocab * (4 + (itemsize if itemsize != 4 else 0))
                ),
                returned_logits=handled,
                returned_logits_bytes=_plain(kept),
                compiled_tiles=compile_tiles,
                weight_grad_sum=_weight_grad_sum(schedule, dtype),
            )
        )
    _rewrite_row_regions(gm, result, skipped_losses, tile_tokens, tile_bytes, drop_logits, compile_tiles,
                         run_compiled_tiles, region)  # fmt: skip
    report.skipped[:0] = list(skipped_losses.values())
    if report.rewrites:
        gm.graph.lint()
        gm.recompile()
    return result


def _rewrite_row_regions(
    gm,
    result: GraphRewrite,
    skipped_losses: dict,
    tile_tokens,
    tile_bytes,
    drop_logits,
    compile_tiles,
    run_compiled_tiles,
    current: list,
) -> None:
    """The general regions (see ``_region_match``): every projection the cross-entropy chain
    did not take whose logits reach a row-wise head with several readers. A loss skipped
    above and taken by a region loses its skip; one in a region that cannot be tiled gets
    the region's reason, which names the op and the line that stopped it."""
    report = result.report
    states = _region_match._autocast_states(gm.graph)
    for node in [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]:
        if node.graph is None:  # erased by an earlier rewrite
            continue
        current[:] = [node]
        try:
            region = _region_match.match_row_region(gm.graph, node, states, drop_logits)
            if region is None:
                continue
            dtype = _val(node).dtype
            vocab = region.program.vocab_size
            tile = choose_tile_tokens(
                vocab, dtype, dtype != torch.float32, tile_tokens=tile_tokens, tile_bytes=tile_bytes,
                device=_val(node).device, fused=compile_tiles,
            )  # fmt: skip
            if tile_tokens is None:
                tile = auto_tile(tile)
            current[:] = [region.projection, region.sink or region.outputs[0].node]
            covered = set(region.nodes) | set(region.reduction_nodes)
            loss_line = source_line(region.sink or region.outputs[0].node)
            handled = _region_match.rewrite_row_region(
                gm.graph, region, tile_tokens=tile, compile_tiles=run_compiled_tiles, result=result,
                autocast_states=states,
            )  # fmt: skip
        except NoMatch as why:
            depends = getattr(why, "depends", set())
            losses = [loss for loss in skipped_losses if loss in depends]
            line = source_line(losses[0]) if losses else source_line(node)
            reason = str(why)
            for loss in losses:  # what the cross-entropy chain alone found, when it says more
                chain = skipped_losses.pop(loss).reason
                if chain not in reason:
                    reason += f"; as a cross-entropy chain: {chain}"
            report.skipped.append(Skip(result.report.index, line, reason))
            continue
        for loss in [loss for loss in skipped_losses if loss in covered]:
            del skipped_losses[loss]
        num_tokens = region.num_tokens
        tokens_hint = optimization_hint(num_tokens, fallback=8192)
        tile_now = effective_tile(tokens_hint, tile)
        itemsize = dtype.itemsize
        returned = [_val(o.node) for o in region.outputs if o.layout.kind == "rows"]
        kept = sum(value.numel() * value.element_size() for value in returned)
        outputs = ", ".join(f"{_region_match.describe_output(o)}" for o in region.outputs)
        shard = region.program.shard  # a vocabulary-sharded head: bytes are this rank's
        parallel = "" if shard is None else _tensor_parallel_text(
            (_val(region.weight).device_mesh.size(), shard[1], vocab)
        )  # fmt: skip
        report.rewrites.append(
            Rewrite(
                graph=report.index,
                matmul_source=source_line(region.projection),
                loss_source=loss_line,
                form=region.program.form + f" => {outputs}" + parallel,
                num_tokens=_plain(num_tokens),
                hidden_size=_plain(_val(region.weight).shape[1]),
                vocab_size=_plain(vocab if shard is None else shard[2]),
                dtype=str(dtype).replace("torch.", ""),
                reduction=(
                    "one scalar loss (its gradient formed in forward)"
                    if region.program.reduction is not None
                    else "per-token outputs (gradient re-derived in backward)"
                ),
                tile_tokens=tile_now,
                num_tiles=_plain((num_tokens + tile_now - 1) // tile_now),
                forward_bytes_avoided=_plain(num_tokens * vocab * _forward_bytes(itemsize, True) - kept),
                backward_bytes_avoided=_plain(num_tokens * vocab * (4 + (itemsize if itemsize != 4 else 0))),
                returned_logits=handled,
                returned_logits_bytes=_plain(kept),
                compiled_tiles=compile_tiles,
                weight_grad_sum=_weight_grad_sum(
                    _weight_grad.schedule_for(dtype, torch.promote_types(torch.float32, dtype))
                    if _val(region.weight).requires_grad
                    else None,
                    dtype,
                ),  # fmt: skip
            )
        )


_SCHEDULE_TEXT = {
    "direct": "formed by the only tile's GEMM, no sum across tiles",
    "split": "float32 sum in two 16-bit planes, rounded over the high one",
    "float32": "float32 sum",
}


def _weight_grad_sum(schedule: str | None, dtype: torch.dtype) -> str:
    """How the tiles will form the weight gradient, and what it holds (see _weight_grad)."""
    if schedule is None:
        return "none"
    what = _SCHEDULE_TEXT[schedule]
    if schedule == "float32" and dtype == torch.float64:
        what = "float64 sum"
    elif schedule == "float32" and dtype != torch.float32:
        what += ", rounded into a separate gradient"
    held = _weight_grad.bytes_per_weight(schedule, dtype)
    return f"{what} ({held} bytes per weight at the end of the loop, the returned gradient included)"


def _forward_bytes(itemsize: int, upcast: bool) -> int:
    """Logits in the model dtype, their fp32 upcast, and the fp32 log-probs saved for backward."""
    return itemsize + (4 if upcast and itemsize != 4 else 0) + 4


def _plain(value) -> int | str:
    return value if isinstance(value, int) else str(value)
