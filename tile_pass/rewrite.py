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

from tile_pass._logging import log
from tile_pass._options import TileOptions
from tile_pass._rewrite_record import optimization_hint, rewrite_record
from tile_pass.match import _region_match, _rules
from tile_pass.match._fold_loops import fold_row_loops
from tile_pass.match._functionalize import functionalize_writes
from tile_pass.match._fx import NoMatch, as_linear, describe, projection_of, same, source_line, val
from tile_pass.match._rule_base import LOSS_SIGNATURES, bind
from tile_pass.plan._plan import RegionCall
from tile_pass.plan._tiling import TileSize, choose_tile_tokens
from tile_pass.program import _region
from tile_pass.program._op_facts import facts_for, spelling
from tile_pass.program._region import RowProgram
from tile_pass.report import GraphReport, Skip
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


def programs_called(graph: torch.fx.Graph) -> tuple[RowProgram, ...]:
    """The programs of the region calls in ``graph``. A compiled graph refers to its programs by
    key only; whatever runs it holds these, so the program registry finds them for as long as the
    graph lives (it forgets only programs no live graph holds)."""
    keys = {
        RegionCall.parse(node.kwargs["call"]).program
        for node in graph.nodes
        if is_region_node(node) and isinstance(node.kwargs.get("call"), str)
    }
    return tuple(_region.lookup(key) for key in sorted(keys))


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
            rewrite_record(report.index, region, val(node), splice, covered, tile, loss_line, options)
        )


def _tile_asked(region, logits, options: TileOptions) -> TileSize:
    """The tile the options ask for: as given, or at most what the byte budget allows (automatic)."""
    dtype = logits.dtype
    tokens = choose_tile_tokens(
        region.program.vocab_size, dtype, dtype != torch.float32, tile_tokens=options.tile_tokens,
        tile_bytes=options.tile_bytes, device=logits.device, fused=options.compile_tiles,
    )  # fmt: skip
    return TileSize(tokens, automatic=options.tile_tokens is None)
