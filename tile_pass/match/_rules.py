"""Which ops act on each token's row of logits independently: one rule per op, and its facts.

A region may contain an op only if a rule proves that the op, run on a tile of rows, gives
those rows' slice of what it gives on all of them. Each rule is registered with every other
fact about its ops (where the op is zero, in which operands it is linear, its sharded form,
whether a per-row loop of it folds, its report name, the signature its arguments bind by, ...)
by :func:`tile_pass.program._op_facts.register_ops`, on the op's canonical key (one for all the
ways Dynamo spells it), in keyword registrations by op family: :mod:`._elementwise_rules`
(elementwise ops and views) and :mod:`._row_rules` (ops over each row's vocabulary, losses),
with the zero rules of :mod:`._zero_rules`. A rule takes the matcher and the node, checks the
node's arguments (the reduced dimension is the vocabulary, an index is per-token, ...) and
returns the :class:`~._rule_base.Classified` steps to replay on a tile, with the facts the
program needs of them (an index to check), or raises :class:`NoMatch` naming what it found.
Anything without a rule stops the region.

Adding an op is one registration in its family's module: its rule (often an existing one) and
its facts.
"""

from __future__ import annotations

import torch.fx

from tile_pass.match import _row_rules  # noqa: F401  (registers the ops over the rows)
from tile_pass.match._elementwise_rules import INPLACE
from tile_pass.match._rule_base import Rule
from tile_pass.program._op_facts import FACTS, OpFacts, spelling


def rule_for(node: torch.fx.Node) -> Rule | OpFacts | None:
    """The row-wise rule of ``node``'s op as spelled (an in-place spelling's is
    :data:`~._elementwise_rules.INPLACE`, if its op's facts allow it); ``None``: the op stops a region."""
    if node.op not in ("call_function", "call_method"):
        return None
    spelled = spelling(node.target)
    facts = None if spelled is None else FACTS.get(spelled.key)
    if facts is None or facts.kind is None:
        return None
    if spelled.inplace:
        return INPLACE if facts.inplace else None
    return facts
