"""The pass never ends a training run: an internal error leaves the graph as Dynamo gave it.

Each phase of the rewrite (matching, planning, rewriting, for a plain cross entropy and for a
z-loss, and the inner compile of the rewritten graph) gets an injected failure; the
step must then run untiled with eager's numbers, log one WARNING and report the region as
skipped with "internal error". ``strict=True`` (``TILE_PASS_STRICT=1``, which the project's own
tests set) raises instead.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass import _settings, rewrite
from tile_pass.match import _region_match
from tile_pass.splice import _splice

N, H, V = 12, 8, 40


def cross_entropy_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def z_loss(h, w, y):  # the logits read twice
    logits = F.linear(h, w)
    return F.cross_entropy(logits, y) + 1e-2 * logits.logsumexp(-1).pow(2).mean()


class Injected(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected")


def _after(real):
    """``real`` runs (and changes the graph), then the failure: a half-rewritten graph."""

    def call(*args, **kwargs):
        real(*args, **kwargs)
        raise Injected("injected after the graph was changed")

    return call


PHASES = {
    "cross entropy matching": (cross_entropy_loss, _region_match, "match_row_region", lambda real: _raise),
    "cross entropy planning": (cross_entropy_loss, rewrite, "choose_tile_tokens", lambda real: _raise),
    "cross entropy rewriting": (cross_entropy_loss, _splice, "rewrite_row_region", _after),
    "z-loss matching": (z_loss, _region_match, "match_row_region", lambda real: _raise),
    "z-loss planning": (z_loss, rewrite, "choose_tile_tokens", lambda real: _raise),
    "z-loss rewriting": (z_loss, _splice, "rewrite_row_region", _after),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def warnings_of_the_pass():
    handler = _Records()
    logger = logging.getLogger("tile_pass")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[::3] = -100
    return h, w, y


@pytest.mark.parametrize("phase", list(PHASES))
def test_an_injected_failure_leaves_the_step_running_with_eagers_numbers(
    phase, monkeypatch, warnings_of_the_pass
):
    fn, module, name, make = PHASES[phase]
    monkeypatch.setattr(module, name, make(getattr(module, name)))
    backend = tile_pass.backend("aot_eager", tile_tokens=4, strict=False)
    h, w, y = _inputs()
    loss = torch.compile(fn, backend=backend)(h, w, y)
    grads = torch.autograd.grad(loss, (h, w))
    h0, w0, _ = _inputs()
    expected = fn(h0, w0, y)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (h0, w0)), strict=True):
        torch.testing.assert_close(got, want)
    report = backend.report()
    assert not report.rewrites
    reasons = [s.reason for s in report.skipped if s.reason.startswith("internal error")]
    assert len(reasons) == 1 and "Injected" in reasons[0], report
    assert len(warnings_of_the_pass) == 1
    assert "internal error" in warnings_of_the_pass[0].getMessage()
    assert "test_fail_safe.py" in warnings_of_the_pass[0].getMessage()  # the region's lines


@pytest.mark.parametrize("phase", ["cross entropy rewriting", "z-loss matching"])
def test_strict_raises_the_internal_error(phase, monkeypatch):
    fn, module, name, make = PHASES[phase]
    monkeypatch.setattr(module, name, make(getattr(module, name)))
    with pytest.raises(Exception, match="injected"):
        torch.compile(fn, backend=tile_pass.backend("eager", tile_tokens=4, strict=True))(*_inputs())


def test_strict_follows_the_environment(monkeypatch):
    for value, strict in (("1", True), ("0", False)):
        monkeypatch.setenv(_settings.STRICT_ENV, value)
        _settings.reload()
        assert tile_pass.backend("eager").strict is strict
        assert tile_pass.backend("eager", strict=not strict).strict is (not strict)
    monkeypatch.setenv(_settings.STRICT_ENV, "maybe")
    with pytest.raises(ValueError, match="TILE_PASS_STRICT"):
        _settings.reload()
    monkeypatch.delenv(_settings.STRICT_ENV)
    _settings.reload()
    monkeypatch.setenv(_settings.STRICT_ENV, "1")
    _settings.reload()


def test_a_rewritten_graph_the_inner_compiler_rejects_is_compiled_as_dynamo_gave_it(warnings_of_the_pass):
    seen = []

    def picky(gm, example_inputs):
        rewritten = any(rewrite.is_region_node(n) for n in gm.graph.nodes)
        seen.append(rewritten)
        if rewritten:
            raise Injected("this compiler rejects tile_pass ops")
        return gm.forward

    backend = tile_pass.backend(picky, tile_tokens=4, strict=False)
    h, w, y = _inputs()
    loss = torch.compile(cross_entropy_loss, backend=backend)(h, w, y)
    h0, w0, _ = _inputs()
    torch.testing.assert_close(loss, cross_entropy_loss(h0, w0, y))
    assert seen == [True, False]
    assert not backend.report().rewrites
    assert "internal error" in backend.report().skipped[-1].reason
    assert len(warnings_of_the_pass) == 1
