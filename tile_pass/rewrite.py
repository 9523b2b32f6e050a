"""Rewrite every LM-head region of a Dynamo graph into one tiled op, and report each one.

The graph is Dynamo's torch-level FX graph; every node carries ``meta["example_value"]``
(a fake tensor, possibly with symbolic sizes), which is how a match is proven exact. Each
LM-head projection is handed to the region matcher (:mod:`tile_pass.match._region_match`), which
builds the row-wise program of everything that reads its logits: the textbook
``F.cross_entropy`` is one such program among z-losses, entropies, log-probs and KL terms.
A loss that no region took is reported with the first op between it and its LM head that
stops a region, or with why it has no head in this graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11/2.12: the same unguarded hint, under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

from tile_pass._logging import log
from tile_pass._options import TileOptions
from tile_pass.match import _region_match, _rules
from tile_pass.match._fold_loops import fold_row_loops
from tile_pass.match._functionalize import functionalize_writes
from tile_pass.match._fx import NoMatch, as_linear, describe, projection_of, same, val
from tile_pass.match._op_facts import RuleKind, facts_for, spelling
from tile_pass.match._records import describe_output
from tile_pass.match._rules import LOSS_SIGNATURES, bind
from tile_pass.plan import _weight_grad
from tile_pass.plan._plan import RegionCall, plan_tiles
from tile_pass.plan._tiling import TileSize, choose_tile_tokens
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program._region import Layout, Step
from tile_pass.report import GraphReport, Rewrite, Skip, logits_bytes_fields, source_line
from tile_pass.splice import _splice
from tile_pass.splice._returned_logits import ReturnedLogits
from tile_pass.tiles.tiled_region import run_region


@dataclass
class GraphRewrite:
    """The result of rewriting one graph: the report, and outputs the backend must rebuild."""

    report: GraphReport
    num_outputs: int = 0
    returned_logits: list[ReturnedLogits] = field(default_factory=list)
    #: the graph as Dynamo gave it, to fall back on if the rewritten one does not compile
    original_graph: torch.fx.Graph | None = None


def rewrite_graph(gm: torch.fx.GraphModule, options: TileOptions, *, graph_index: int = 0) -> GraphRewrite:
    """Rewrite every exactly-matched region of ``gm`` in place; report every candidate.

    ``options.compile_tiles`` is the plan (tile sizes follow its byte model, the report says
    it); ``options.runs_compiled_tiles`` is what the rewritten graph runs (``explain`` runs
    uncompiled tiles of the planned sizes, to stay quick).

    The pass is only an optimisation, so it must never be why a training run dies: an error
    other than a deliberate no-match, raised while matching, planning or rewriting a region,
    puts back the graph as Dynamo gave it (every region of it), logs a WARNING naming the
    error and the region's lines, and is reported as a skip ("internal error: ..."). With
    ``strict`` (the project's own tests, ``TILE_PASS_STRICT=1``) it is raised instead."""
    pristine = _copy_graph(gm.graph)
    region: list[torch.fx.Node] = []  # the nodes of the region being rewritten, for the report
    try:
        # in-place writes replayed out of place (verl's logits.div_(T)), and per-row loops (TRL's
        # selective_log_softmax) folded into one row-wise op: each kept only if that lets the pass
        # tile a region; else the regions are found again in the graph without it
        functionalized = functionalize_writes(gm)
        if fold_row_loops(gm):
            result = _rewrite_regions(gm, graph_index, options, region)
            if result.report.rewrites:
                result.original_graph = pristine
                return result
            _restore(gm, pristine)
            if functionalized:
                functionalize_writes(gm)
        result = _rewrite_regions(gm, graph_index, options, region)
        if functionalized and not result.report.rewrites:
            _restore(gm, pristine)  # the reasons stand: they name the ops as the user wrote them
        result.original_graph = pristine
        return result
    except Exception as error:
        if options.strict:
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
    return node.target is run_region or (getattr(node.target, "namespace", None) == "tile_pass")


def _restore(gm: torch.fx.GraphModule, pristine: torch.fx.Graph) -> None:
    gm.graph = _copy_graph(pristine)
    gm.recompile()


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


def _rewrite_regions(gm, graph_index: int, options: TileOptions, region: list) -> GraphRewrite:
    result = GraphRewrite(GraphReport(index=graph_index))
    report = result.report
    losses = [
        n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.cross_entropy, F.nll_loss)
    ]
    _rewrite_row_regions(gm, result, losses, options, region)
    # a loss no region took, nor reported: why its logits were not tiled
    report.skipped[:0] = [
        Skip(graph_index, source_line(loss), _why_untiled(loss)) for loss in losses if loss.graph is not None
    ]
    reported = {_row_wise_root(bind(LOSS_SIGNATURES[loss.target], loss).get("input")) for loss in losses}
    report.skipped += _unaccounted_heads(gm.graph, graph_index, report, reported)
    if report.rewrites:
        gm.graph.lint()
        gm.recompile()
    return result


GRAPH_BREAK = (
    "the logits are an input of this graph: a graph break separates the LM head from "
    "the loss, so the pass sees only one half. Find the break with "
    'TORCH_LOGS="graph_breaks" and remove it (e.g. a print or logging call between '
    "the head and the loss), or compute the loss in the function that calls the head"
)


#: a head's skip says this when its ``[N, V]`` output leaves the graph whole (the backend then
#: names the graph break that ended the graph, if one did)
LEFT_WHOLE = "leaves graph"


def _why_untiled(loss: torch.fx.Node) -> str:
    """The reason a loss no region took is not tiled: the walk from its input back to the
    LM head names the first op on the way that stops a region (or why there is no head)."""
    options = bind(LOSS_SIGNATURES[loss.target], loss)
    node = options.get("input")
    path: list[torch.fx.Node] = []
    while True:
        if not isinstance(node, torch.fx.Node):
            return "the loss input is not computed in this graph"
        if node.op == "placeholder":
            return GRAPH_BREAK
        try:
            if as_linear(node) is not None:
                break
        except NoMatch as why:
            return str(why)
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)] or node.all_input_nodes
        if node.op not in ("call_function", "call_method") or not inputs:
            return f"the loss input comes from {describe(node)}, not from a linear layer"
        path.append(node)
        node = inputs[0]
    path.reverse()  # from the head towards the loss
    for reader in path:
        if _rules.rule_for(reader) is None:
            return f"{describe(reader)} has no row-wise rule, so the logits would have to exist whole"
    stopped = _region_match.first_stop(loss.graph, node, path)
    if stopped is not None:
        return str(stopped)
    return f"the LM head at {source_line(node)} reaches the loss, but no row-wise region of it was found"


def _unaccounted_heads(
    graph: torch.fx.Graph, graph_index: int, report: GraphReport, reported: set
) -> list[Skip]:
    """Every head the pass sees is rewritten or named: the log-probs, log-sum-exp, gather or KL
    of logits handed in as a graph input (a graph break before them: the same reason a cross
    entropy there gets), and a projection whose ``[N, V]`` output the graph returns whole with
    nothing here reading it as logits (the other half of such a break, or a forward that only
    returns logits): nothing of either is tiled, and the report says so."""
    skips: list[Skip] = []
    seen = set(reported)  # the inputs a loss's own skip already names
    for node in graph.nodes:
        facts = facts_for(node.target) if node.op in ("call_function", "call_method") else None
        if facts is None or not facts.head_sign or spelling(node.target).inplace or not node.args:
            continue
        root = _row_wise_root(node.args[0])
        if root is not None and root.op == "placeholder" and root not in seen and not _feeds_region(node):
            seen.add(root)
            skips.append(Skip(graph_index, source_line(node), GRAPH_BREAK))
    lines = {s.loss_source for s in report.skipped} | {r.matmul_source for r in report.rewrites}
    for node in graph.nodes:
        whole = _returned_whole(node)
        if whole is not None and source_line(node) not in lines:
            shape = " x ".join(str(size) for size in whole.shape)
            skips.append(Skip(graph_index, source_line(node), (
                f"the [{shape}] output of the projection at {source_line(node)} {LEFT_WHOLE} "
                f"{graph_index} whole (the graph returns it) and nothing in this graph reads it as logits, "
                "so nothing is tiled and the whole tensor is kept. If it is an LM head whose loss is in "
                "another graph (a graph break after the head), that graph's skip names the break; if the "
                "caller computes the loss from the returned logits, compute it in the compiled function "
                "instead (return the loss, or pass labels to the model)"
            )))  # fmt: skip
    return skips


def _feeds_region(node: torch.fx.Node) -> bool:
    """Whether a rewritten region reads ``node``'s value (a teacher's given logits, its log-probs
    read per token by the student's tiles): then it is an input of that region, not a lost head."""
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if is_region_node(user):
                return True
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return False


def _row_wise_root(node) -> torch.fx.Node | None:
    """Where the first-operand chain of row-wise ops ending at ``node`` starts."""
    while isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method"):
        if _rules.rule_for(node) is None or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def _returned_whole(node: torch.fx.Node) -> torch.Tensor | None:
    """The output of ``node``, a projection to more features than it reads (a vocabulary), if the
    graph returns it (or a view or cast of it with the same rows) whole; else ``None``."""
    linear = projection_of(node) if node.op in ("call_function", "call_method") else None
    out, weight = val(node), val(linear[1]) if linear is not None else None
    if out is None or weight is None or weight.dim() != 2:
        return None
    if not _plain_larger(weight.shape[0], weight.shape[1]):
        return None
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.op == "output":
                return out
            value = val(user)
            if user in seen or value is None or value.dim() == 0 or not same(value.shape[-1], out.shape[-1]):
                continue
            seen.add(user)
            if _rules.rule_for(user) is not None and not facts_for(user.target).head_sign:
                stack.append(user)
    return None


def _plain_larger(a, b) -> bool:
    try:
        return int(optimization_hint(a, fallback=0)) > int(optimization_hint(b, fallback=0))
    except (TypeError, ValueError):
        return False


def _rewrite_row_regions(
    gm,
    result: GraphRewrite,
    losses: list[torch.fx.Node],
    options: TileOptions,
    current: list,
) -> None:
    """Every LM-head projection's region (see ``_region_match``), rewritten or skipped with the
    reason that names the op and the line that stopped it. ``losses`` keeps the loss nodes no
    region has taken or reported yet (the caller explains those)."""
    report = result.report
    states = _region_match._autocast_states(gm.graph)
    skipped_heads: dict[torch.fx.Node, Skip] = {}  # a head tried alone before another region took it
    for node in [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]:
        if node.graph is None or node._erased:  # erased by an earlier rewrite (a partner head's included)
            continue
        current[:] = [node]
        covered: set[torch.fx.Node] = set()  # the nodes of a matched region
        try:
            region = _region_match.match_row_region(gm.graph, node, states, options.drop_logits)
            if region is None:
                continue
            tile = _tile_asked(region, val(node), options)
            current[:] = [region.projection, region.sink or region.outputs[0].node]
            covered = set(region.nodes) | set(region.reduction_nodes)
            loss_line = source_line(region.sink or region.outputs[0].node)
            splice = _splice.rewrite_row_region(
                gm.graph, region, call=RegionCall(region.program.key, tile, options.runs_compiled_tiles),
                result=result, autocast_states=states,
            )  # fmt: skip
        except NoMatch as why:  # the reason replaces those of the losses it holds
            depends = why.depends or covered
            held = [loss for loss in losses if loss in depends]
            line = source_line(held[0]) if held else source_line(node)
            losses[:] = [loss for loss in losses if loss not in depends]
            skip = Skip(result.report.index, line, str(why), eager_raises=why.eager_raises)
            report.skipped.append(skipped_heads.setdefault(node, skip))
            continue
        losses[:] = [loss for loss in losses if loss not in covered]
        for head in covered & skipped_heads.keys():  # a teacher head computed first, now a partner
            report.skipped.remove(skipped_heads.pop(head))
        report.rewrites.append(
            _rewritten(report.index, region, val(node), splice, covered, tile, loss_line, options)
        )


def _tile_asked(region, logits, options: TileOptions) -> TileSize:
    """The tile the options ask for: as given, or at most what the byte budget allows (automatic)."""
    dtype = logits.dtype
    tokens = choose_tile_tokens(
        region.program.vocab_size, dtype, dtype != torch.float32, tile_tokens=options.tile_tokens,
        tile_bytes=options.tile_bytes, device=logits.device, fused=options.compile_tiles,
    )  # fmt: skip
    return TileSize(tokens, automatic=options.tile_tokens is None)


def _rewritten(
    graph: int, region, logits, splice, covered, tile: TileSize, loss_line: str, options
) -> Rewrite:
    """The report's record of one rewritten region: the plan the tile loop will make for the sizes'
    hints (the same :func:`tile_pass.plan._plan.plan_tiles`), the bytes it avoids, how it was spliced."""
    dtype, vocab, num_tokens = logits.dtype, region.program.vocab_size, region.num_tokens
    weight, tokens = val(region.weight), optimization_hint(num_tokens, fallback=8192)  # unguarded hints
    # the loop's head: this rank's vocabulary rows when sharded
    shape = (optimization_hint(vocab, fallback=4096), optimization_hint(weight.shape[1], fallback=4096))
    tile_plan = plan_tiles(tokens, tokens, tile, shape, dtype, weight.device, options.compile_tiles)
    backward = any(o.differentiable for o in region.outputs)  # none under torch.no_grad()
    returned = [val(o.node) for o in region.outputs if o.shape.layout is Layout.ROWS]
    returned += [val(node) for node in region.kept_whole]
    kept = sum(value.numel() * value.element_size() for value in returned)
    outputs = ", ".join(f"{describe_output(o)}" for o in region.outputs)
    shard = region.program.shard  # a vocabulary-sharded head: bytes are this rank's
    parallel = ""
    if shard is not None:
        degree = torch.distributed.distributed_c10d._resolve_process_group(shard[0]).size()
        parallel = (f" [tensor-parallel: degree {degree}, this rank's vocabulary rows {shard[1]}.."
                    f"{shard[1] + vocab - 1}; bytes per rank]")  # fmt: skip
    return Rewrite(
        graph=graph,
        matmul_source=source_line(region.projection),
        loss_source=loss_line,
        form=" -> ".join(region.steps_text) + f" => {outputs}" + parallel,
        num_tokens=_plain(num_tokens),
        hidden_size=_plain(weight.shape[1]),
        vocab_size=_plain(vocab if shard is None else shard[2]),
        dtype=str(dtype).replace("torch.", ""),
        reduction=_reduction_text(region, covered, backward),
        tile_tokens=tile_plan.tile,
        num_tiles=_plain((num_tokens + tile_plan.tile - 1) // tile_plan.tile),
        **logits_bytes_fields(
            num_tokens * vocab, dtype.itemsize, kept, tile_plan.tile_bytes, _plain, backward=backward,
            grad_buffer=_gradients_formed(region, tile_plan, tokens, shape, dtype),
        ),
        returned_logits=splice.returned_logits,
        returned_logits_bytes=_plain(kept),
        compiled_tiles=options.compile_tiles,
        weight_grad_sum=_weight_grad_sum(
            tile_plan.schedule if weight.requires_grad and backward else None, dtype
        ),
        token_skipping=_token_skipping(region),
        backward=backward,
        loss_grad_ops=_loss_grad_ops(region.program),
    )


def _gradients_formed(region, tile_plan, num_tokens, head_shape, dtype):
    """Bytes of the gradients the tile loop forms while its buffers live: the weight's sum under
    its schedule and the hidden states' (one row a token), where they need one."""
    weight, hidden = val(region.weight), val(region.hidden)
    held = 0
    if weight is not None and weight.requires_grad:
        held += _weight_grad.bytes_per_weight(tile_plan.schedule, dtype) * head_shape[0] * head_shape[1]
    if hidden is not None and hidden.requires_grad:
        held += num_tokens * head_shape[1] * hidden.dtype.itemsize
    return held


def _loss_grad_ops(program) -> str:
    """The ops that turn each row of ``[N, V]`` values into per-token values, whose ``[N, V]``
    input gradient an unfused backward makes (a cross entropy's is ``nll_loss``'s)."""
    facts = {step.target: found for step in program.steps if (found := facts_for(step.target)) is not None}
    losses = {"nll_loss" if f.key in ("cross_entropy", "nll_loss") else f.key: None
              for f in facts.values() if f.kind is RuleKind.LOSS}  # fmt: skip
    if losses:  # a cross entropy's is nll_loss's; a KL's, kl_div's
        return " and ".join(losses)
    reads = (RuleKind.GATHER, RuleKind.VOCAB_REDUCTION)
    names = {Step.describe(step): None for step in program.steps
             if step.target in facts and facts[step.target].kind in reads}  # fmt: skip
    return " and ".join(names) or "the loss"


def _reduction_text(region, covered: set, backward: bool = True) -> str:
    """The eager reduction of the region's one loss call when that loss is all it computes
    (beside returned logits), else the steps of a hand-written scalar loss's reduction,
    and whether the op forms the loss's gradient in forward (one scalar), in backward, or not at all."""
    calls = [n for n in covered if n.op == "call_function" and n.target in LOSS_SIGNATURES]
    eager = None
    if len(calls) == 1 and [o.node for o in region.outputs if o.shape.layout is not Layout.ROWS] == calls:
        options = bind(LOSS_SIGNATURES[calls[0].target], calls[0])
        eager = options["reduction"] if isinstance(options["reduction"], str) else None
    if region.program.reduction is not None:
        scalar = "one scalar loss (its gradient formed in forward)"
        if not region.program.reduction.linear:
            scalar = ("one scalar loss, nonlinear in the tokens' outputs (its gradient formed in forward, "
                      "each tile holding the tokens the loss couples, or a group longer than a tile in "
                      "per-summary sums; where neither applies, two passes: the debug log says which "
                      "ran)")  # fmt: skip
        steps = " -> ".join(
            step.describe()
            for step in region.program.reduction.steps  # the user's ops
            if not getattr(step.target, "__module__", "").startswith("tile_pass")
        )
        return f"{eager or steps or 'its own steps'}: {scalar}"
    if not backward:
        return eager or "per-token outputs (no gradient: no output needs one, so no backward runs)"
    return eager or "per-token outputs (gradient re-derived in backward)"


_SCHEDULE_TEXT = {
    WeightGradSchedule.DIRECT: "formed by the only tile's GEMM, no sum across tiles",
    WeightGradSchedule.SPLIT: "float32 sum in two 16-bit planes, rounded over the high one",
    WeightGradSchedule.FLOAT32: "float32 sum",
}


def _weight_grad_sum(schedule: WeightGradSchedule | None, dtype: torch.dtype) -> str:
    """How the tiles will form the weight gradient, and what it holds (see _weight_grad)."""
    if schedule is None:
        return "none"
    what = _SCHEDULE_TEXT[schedule]
    if schedule is WeightGradSchedule.FLOAT32 and dtype == torch.float64:
        what = "float64 sum"
    elif schedule is WeightGradSchedule.FLOAT32 and dtype != torch.float32:
        what += ", rounded into a separate gradient"
    held = _weight_grad.bytes_per_weight(schedule, dtype)
    return f"{what} ({held} bytes per weight at the end of the loop, the returned gradient included)"


def _token_skipping(region) -> str:
    """Which tokens the tiles may leave out (``tiled_region._skipped_rows`` decides per batch), or
    the output that makes every token run: a token is left out only where every output is zero
    whatever its logits, or reaches the loss with a zero token weight."""
    outputs = list(zip(region.outputs, region.program.outputs, strict=True))
    rows = [found for found, out in outputs if out.layout is Layout.ROWS]
    if rows:
        return f"none: the graph returns the logits of every token ({rows[0].node.name})"
    always = [found for found, out in outputs if out.zeros is None and not out.only_loss]
    if always:
        return (
            f"none: {always[0].node.name} is read outside the loss and is not zero at an ignored label or a "
            "zero mask"
        )
    kinds = [
        "an ignored label or a zero mask" if any(out.zeros is not None for _, out in outputs) else "",
        "a zero token weight in the loss" if any(o.only_loss and o.zeros is None for _, o in outputs) else "",
    ]
    return (
        f"on CPU, tokens where every output is zero ({' or '.join(filter(None, kinds))}) run no GEMM; "
        "an accelerator runs every token (finding them would synchronise with the host)"
    )


def _plain(value) -> int | str:
    hint = None if isinstance(value, int) else value.node.hint  # None: an unbacked size has no value
    return value if isinstance(value, int) else str(value) if hint is None else f"{value} ({hint} at compile)"
