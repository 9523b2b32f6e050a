"""The matcher's one record per region node: one lookup gives what it proved, and the records
refuse facts that contradict each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tile_pass.match import _region_match
from tile_pass.match._fx import NoMatch, as_linear
from tile_pass.match._records import ProgramValue, RegionValue, SliceMode
from tile_pass.match._rule_base import AfterTiles, Shape
from tile_pass.program._op_facts import RuleKind
from tile_pass.program._region import Layout
from tile_pass.program._token_layout import TokenReduction


def _dynamo_graph(fn, *args) -> torch.fx.Graph:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0].graph


def _head(node: torch.fx.Node) -> bool:
    try:
        return node.op == "call_function" and as_linear(node) is not None
    except NoMatch:
        return False


def ce_and_kl(h, w, y):
    logits = F.linear(h, w)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, w.shape[0]), y[:, 1:].reshape(-1))
    log_p, log_q = logits.log_softmax(-1), logits.detach().log_softmax(-1)
    return ce + F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)


def test_one_record_per_node_holds_every_fact():
    h, w = torch.randn(2, 8, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    graph = _dynamo_graph(ce_and_kl, h, w, torch.randint(0, 50, (2, 8)))
    projection = next(n for n in graph.nodes if _head(n))
    states = _region_match._autocast_states(graph)
    matcher = _region_match._walked(
        graph, projection, as_linear(projection), states, False, SliceMode.SELECTED
    )
    ce = next(r for node, r in matcher.values.items() if node.target is F.cross_entropy)
    kl = next(r for node, r in matcher.values.items() if node.target is F.kl_div)
    assert ce.after_tiles.how is TokenReduction.MEAN_VALID and ce.shape.layout is Layout.REDUCED
    assert ce.value.shape.layout is Layout.TOKENS and ce.value.kind is RuleKind.LOSS
    assert ce.selection == 0 and ce.value.zeros is not None  # the row selection; zero at an ignored label
    assert kl.after_tiles.how is TokenReduction.DIV_FIRST_DIM and kl.value.step.target == "sum"
    for record in matcher.values.values():  # each value is the program's own
        assert matcher.program[record.value.index] is record.value
    # a second pass over the same graph starts from nothing the first one proved
    again = _region_match._walked(graph, projection, as_linear(projection), {}, False)
    assert all(r.selection is None for r in again.values.values())


def test_records_refuse_contradicting_facts():
    rows = Shape(Layout.ROWS, (4,))
    logits = ProgramValue(0, None, rows)
    with pytest.raises(ValueError, match="no step"):
        ProgramValue(1, None, Shape(Layout.TOKENS, (4,)))
    with pytest.raises(ValueError, match="reduced"):
        RegionValue(logits, Shape(Layout.REDUCED, (4,)))  # reduced, but no token reduction left
    with pytest.raises(ValueError, match="reduced"):
        RegionValue(logits, rows, after_tiles=AfterTiles(TokenReduction.SUM))
    with pytest.raises(ValueError, match="pieces"):
        RegionValue(logits, rows, pieces=((slice(0, 2),),))  # pieces of nothing
