"""Find the row-wise region of an LM-head projection in a Dynamo graph, phase by phase.

A region is an LM-head projection plus every node that uses its logits row by row, with
as many outputs as the user's code takes from it. The matcher's phases, each a module with a
typed input and output, all reading one :class:`~tile_pass.match._matcher.RegionMatcher`:

* **the projection** (:func:`tile_pass.match._fx.as_linear`): ``F.linear``/``x @ W.T`` with a 2-D
  weight, its autocast dtype, its vocabulary shard (:mod:`._sharding`);
* **the region** (:func:`._walk.walk`): every node that depends on the logits is classified, in
  graph order, by the rule registered for its op (:mod:`tile_pass.match._rules`); a node joins
  the region when its rule proves it row-wise and every logits-dependent operand is already in
  the region, and leaves one :class:`~._records.RegionValue` of all that was proved about it.
  Token slices and row selections of the logits (:mod:`._selections`) and partner heads
  (:mod:`._partners`) are taken on the way;
* **the outputs** (:func:`._walk.collect_outputs`): region values read outside it.
  Per-token values (losses, log-probs, log-sum-exps, ``argmax``) leave the tiles flat; a token
  reduction folded into an op (a mean cross entropy) is finished after them; rows (``[N, V]``)
  may only be returned, and are written tile by tile, with a gradient path replayed if the
  caller uses it;
* **the scalar loss** (:func:`._scalar_loss.scalar_loss`): when the differentiable outputs
  reach exactly one scalar through token reductions linear in them, those nodes join the op,
  which then forms the whole gradient in forward (:mod:`tile_pass.tiles.tiled_region`);
* **the program** (:func:`._build.build_region`): the region's steps registered as one
  :class:`~tile_pass.program._region.RowProgram`, and the region's record.

The splice (:func:`tile_pass.splice._splice.rewrite_row_region`) then replaces the region with
one call of the program. Anything unproven raises :class:`~tile_pass.match._fx.NoMatch` with the
op and the line that stopped the region, and the graph is left as it was.
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass._logging import log
from tile_pass.match._build import build_region
from tile_pass.match._fx import NoMatch, as_linear, projection_of
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._partners import unused_partners
from tile_pass.match._records import RowRegion, SliceMode
from tile_pass.match._scalar_loss import scalar_loss
from tile_pass.match._sharding import head_shard
from tile_pass.match._walk import collect_outputs, walk

_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def _autocast_states(graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple]:
    """Per node, the autocast contexts Dynamo recorded around it, innermost last."""
    states, stack = {}, []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _ENTER_AUTOCAST:
            stack.append((node, tuple(node.args[:3])))
        elif node.op == "call_function" and node.target is _EXIT_AUTOCAST and stack:
            stack.pop()
        states[node] = tuple(s for _, s in stack)
    return states


def match_row_region(
    graph: torch.fx.Graph, projection: torch.fx.Node, autocast_states=None, drop_rows: bool = False
) -> RowRegion | None:
    """The row-wise region of ``projection``; None if it is not an LM head's; raises ``NoMatch``."""
    linear = projection_of(projection)
    if linear is None:
        return None
    states = autocast_states or _autocast_states(graph)
    matcher = None
    try:
        return _build_region(matcher := _walked(graph, projection, linear, states, drop_rows))
    except NoMatch as stopped:
        if matcher is None:
            raise
        why = stopped.but(depends=matcher.depends)  # the skip replaces the reports of the losses it holds
        if not matcher.slices and not matcher.saw_selection:
            raise why from None
        return _select_rows(graph, projection, linear, states, drop_rows, why, bool(matcher.slices))


def _select_rows(
    graph, projection, linear, states, drop_rows, why: NoMatch, sliced: bool
) -> RowRegion | None:
    """The passes after the first, when it stopped on a slice or a selection of the logits' rows: a
    token slice read beside all rows (DPO's NLL on the chosen half), slices of a slice, chunks of
    regrouped rows. They keep the later slices (then every slice) selections of the tiles' rows;
    if none of them tiles, the reason of the pass that got furthest through the graph stands."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    shown = why
    for mode in (SliceMode.FIRST_MOVED, SliceMode.SELECTED) if sliced else (SliceMode.SELECTED,):
        try:
            return _build_region(_walked(graph, projection, linear, states, drop_rows, mode))
        except NoMatch as other:
            log.debug("the matching pass with %s stopped too: %s", mode.value, other)
            if order.get(other.node, -1) > order.get(shown.node, -1):
                shown = other.but(depends=why.depends)
    raise shown from None


def _walked(graph, projection, linear, states, drop_rows, slice_mode=SliceMode.MOVED) -> RegionMatcher:
    """A matcher after the walk; walked again without the partner heads it did not combine with."""
    excluded: set[torch.fx.Node] = set()
    shard = head_shard(linear[0], linear[1], projection)
    while True:
        matcher = RegionMatcher(graph, projection, linear, states, drop_rows, slice_mode, excluded, shard)
        walk(matcher)
        unused = unused_partners(matcher)
        if not unused:
            return matcher
        excluded = excluded | unused


def first_stop(
    graph: torch.fx.Graph, projection: torch.fx.Node, readers: list[torch.fx.Node]
) -> NoMatch | None:
    """Why the region of ``projection`` does not reach through ``readers`` (a path from its
    logits, in graph order): the reason of the first reader outside it, or the region's own."""
    try:
        matcher = _walked(graph, projection, as_linear(projection), _autocast_states(graph), False)
        stopped = next((matcher.outside[r] for r in readers if r in matcher.outside), None)
        if stopped is None:
            collect_outputs(matcher)  # raises the region's own reason, if it has one
        return stopped
    except NoMatch as why:
        return why


def _build_region(matcher: RegionMatcher) -> RowRegion | None:
    """The outputs, the scalar loss, then the program registered and the region's record; None if
    the region holds no head."""
    found = collect_outputs(matcher)
    if found is None:
        return None
    return build_region(matcher, found, scalar_loss(matcher, found.outputs))
