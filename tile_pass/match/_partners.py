"""Partner heads: other projections onto the same vocabulary whose logits the region's readers
combine with its own row by row (a frozen teacher's head, a second trained head), computed in
the same tiles."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass.match._fx import NoMatch, as_linear, projection_of, same, val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._records import RowInput, TokenInput
from tile_pass.match._rule_base import Classified, Shape
from tile_pass.match._sharding import vocab_shard
from tile_pass.program._op_facts import RuleKind
from tile_pass.program._region import Layout, Ref, RefKind


def descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def partner_projections(matcher: RegionMatcher) -> set[torch.fx.Node]:
    """Other projections onto the same vocabulary whose logits this region's readers combine
    with row by row (a frozen teacher's head beside the student's, or a second trained head:
    its weight's and hidden states' gradients are derived in the tiles as the first head's):
    each tile computes their logits too, so neither head's ``[N, V]`` logits exist."""
    mine = descendants(matcher.projection) | {matcher.projection}
    partners = set()
    for node in matcher.graph.nodes:
        if node in mine or node in matcher.excluded or node.op not in ("call_function", "call_method"):
            continue
        linear = projection_of(node)
        out = val(node)
        if linear is None or out is None or not same(out.shape[-1], matcher.vocab):
            continue
        if out.requires_grad and not _trained_partners_allowed(matcher):
            continue
        weight = val(linear[1])
        if (
            linear[1] in mine
            or weight is None
            or weight.dim() != 2
            or not _sharded_alike(matcher, linear, out)
        ):
            continue
        if any(u in mine for u in descendants(node)):
            partners.add(node)
    return partners


def _trained_partners_allowed(matcher: RegionMatcher) -> bool:
    """A trained second head joins a trained first one (a frozen head never leads a trained one:
    the trained head's own region takes the frozen one as its partner), on whole heads only
    (the tensor-parallel tiles' group-wide steps are proven for frozen partners alone)."""
    return matcher.shard is None and bool(getattr(val(matcher.projection), "requires_grad", False))


def _sharded_alike(matcher: RegionMatcher, linear, out) -> bool:
    """Whether a partner head is split over the vocabulary as this head is: neither sharded,
    or both ``Shard(0)`` on one mesh with the same rows on this rank (its logits then meet
    this head's column for column, and the tiles compute this rank's piece of both)."""
    weight = val(linear[1])
    if matcher.shard is None or not hasattr(weight, "placements"):
        return matcher.shard is None and not hasattr(weight, "placements")
    try:
        return vocab_shard(val(linear[0]), weight, out) == matcher.shard
    except NoMatch:
        return False


def add_partner(matcher: RegionMatcher, node: torch.fx.Node) -> None:
    """The partner projection ``node`` as a step: ``F.linear`` of its hidden states (sliced
    per tile, a per-token input) and its weight and bias (shared by every row)."""
    hidden, weight, bias, transpose, _ = as_linear(node)
    hidden_val, out_val = val(hidden), val(node)
    tokens = tuple(out_val.shape[:-1])
    if hidden_val is None or not same(hidden_val.shape[-1], val(weight).shape[1]):
        raise NoMatch("{} projects hidden states that do not match its weight", node)
    if matcher.slices:
        raise NoMatch("{} is a second head after the logits' token rows were sliced", node)
    trained = out_val.requires_grad  # a trained second head: its gradients are derived in the tiles too
    # its logits are computed on all rows (no row selection)
    entry = TokenInput(hidden, (hidden_val.shape[-1],), matcher.flat_tokens(tokens, node, None),
                       differentiable=trained and hidden_val.requires_grad)  # fmt: skip
    matcher.token_inputs.append(entry)
    matcher.partner_inputs.append(entry)
    args = [Ref(RefKind.TOKEN, len(matcher.token_inputs) - 1)]
    for operand in (weight, bias):
        if operand is not None:
            grad = trained and bool(getattr(val(operand), "requires_grad", False))
            matcher.row_inputs.append(RowInput(operand, False, whole=True, differentiable=grad))
            matcher.partner_inputs.append(matcher.row_inputs[-1])
            args.append(Ref(RefKind.ROW, len(matcher.row_inputs) - 1))
    classified = Classified(matcher.step(node, F.linear, args), Shape(Layout.ROWS, tokens))
    matcher.add(node, classified, RuleKind.ELEMENTWISE)
    matcher.no_gradient_through(node)
    matcher.partners[node] = transpose if transpose is not None and list(transpose.users) == [node] else None


def unused_partners(matcher: RegionMatcher) -> set[torch.fx.Node]:
    """The partner heads no region value combines with this head's logits (their readers
    meet only outside the region, as two losses added together do)."""
    origin: dict[torch.fx.Node, frozenset] = {matcher.projection: frozenset({matcher.projection})}
    origin.update((p, frozenset({p})) for p in matcher.partners)
    met: set[torch.fx.Node] = set()
    for node in matcher.values:
        if node not in origin:
            origin[node] = frozenset().union(*(origin.get(a, ()) for a in node.all_input_nodes))
        if matcher.projection in origin[node]:
            met |= origin[node]
    return set(matcher.partners) - met
