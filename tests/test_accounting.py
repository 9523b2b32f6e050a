"""No head is left whole in silence: every projection to the vocabulary the pass is handed is
rewritten or named in the report with its line.

The walker below is an inner compiler: it receives each graph after the pass and counts the
projections still in it (as ``tile_pass.rewrite`` sees heads: ``F.linear`` / ``h @ W.T`` to
more features than they read). Each one left must have a skip of its own in that graph.
"""

from __future__ import annotations

import losses_as_written as L
import pytest
import test_inplace
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass.match._fx import NoMatch, as_linear, val

B, T, H, V = 2, 6, 8, 40


def _heads(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    heads = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        try:
            linear = as_linear(node)
        except NoMatch:
            continue
        weight = val(linear[1]) if linear is not None else None
        if weight is not None and weight.dim() == 2 and weight.shape[0] > weight.shape[1]:
            heads.append(node)
    return heads


class _Walker:
    """An inner compiler that records, per graph, the heads the rewritten graph still holds."""

    def __init__(self):
        self.left: list[int] = []

    def __call__(self, gm, example_inputs):
        self.left.append(len(_heads(gm)))
        return gm.forward


def _assert_accounted(fn, *args):
    torch._dynamo.reset()
    walker = _Walker()
    backend = tile_pass.backend(walker, tile_tokens=3)
    out = torch.compile(fn, backend=backend)(*args)
    report = backend.report()
    per_graph = [len([s for s in report.skipped if s.graph == i]) for i in range(len(walker.left))]
    for index, (left, skipped) in enumerate(zip(walker.left, per_graph, strict=True)):
        assert left <= skipped, f"graph {index}: {left} head(s) left whole, report:\n{report}"
    return out, report


def _data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    y = torch.randint(0, V, (B, T), generator=g)
    return h, w, y


# --------------------------------------------------------------- fixtures from the other suites

_INPLACE = [*test_inplace.TILED, test_inplace.view_then_write]


@pytest.mark.parametrize("fn", _INPLACE, ids=lambda f: f.__name__)
def test_inplace_fixtures_account_for_every_head(fn):
    h, w, y = test_inplace._data("cpu")
    _assert_accounted(fn, h.requires_grad_(), w.requires_grad_(), y)


_PREFERENCE = ["dpo", "kto", "dpo_margin_in_place"]


@pytest.mark.parametrize("name", _PREFERENCE)
def test_preference_fixtures_account_for_every_head(name):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 5, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    y = torch.randint(0, V, (4, 5), generator=g)
    extra = (torch.randn(2, generator=g), torch.randn(2, generator=g))
    _assert_accounted(getattr(L, name), x.requires_grad_(), w.requires_grad_(), b, y, *extra)


# --------------------------------------------------------------- the cases that were silent


def _log_probs_of_input(logits, y):
    return -F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).mean()


def test_log_softmax_on_logits_from_outside_is_named_as_a_graph_break():
    """As a cross entropy there is: the log-probs read logits the graph did not compute."""
    h, w, y = _data()
    _, report = _assert_accounted(_log_probs_of_input, (h @ w.T).detach().requires_grad_(), y)
    assert len(report.skipped) == 1, str(report)
    assert "the logits are an input of this graph" in report.skipped[0].reason
    assert "test_accounting.py" in report.skipped[0].loss_source


def _log_probs_with_optional_kernel(logits, labels):  # OpenRLHF's log_probs_from_logits
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    except ImportError:
        pass
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def _step_with_import_break(h, w, y):
    return _log_probs_with_optional_kernel(h @ w.T, y).mean()


def test_head_before_a_failed_import_says_its_logits_leave_whole_and_why():
    """The failed import ends the graph and Dynamo runs the helper eagerly: the pass never sees
    the loss. The head's graph says its logits leave it whole, names the import and its fix."""
    h, w, y = _data()
    out, report = _assert_accounted(_step_with_import_break, h, w, y)
    torch.testing.assert_close(out, _step_with_import_break(h, w, y))
    reasons = [s.reason for s in report.skipped]
    assert len(reasons) == 1, str(report)
    assert "leaves graph 0 whole" in reasons[0] and "[2 x 6 x 40]" in reasons[0], reasons[0]
    assert "Import failure" in reasons[0] and "import it once at module level" in reasons[0], reasons[0]


def _forward_only(h, w):
    return (h @ w.T).float()


def test_forward_returning_logits_says_nothing_is_tiled():
    h, w, _ = _data()
    _, report = _assert_accounted(_forward_only, h, w)
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    assert "leaves graph 0 whole" in report.skipped[0].reason


def _down_projection(h, w):
    return h @ w.T


def test_hidden_projection_is_not_a_head():
    """A projection to fewer features than it reads (a down-projection) is no vocabulary head."""
    h, _, _ = _data()
    _, report = _assert_accounted(_down_projection, h, torch.randn(4, H, requires_grad=True))
    assert not report.skipped, str(report)
