"""A step's host work: what depends only on the program and the shapes is decided once.

The one-tile step of ``python -m tile_pass.bench --host-overhead`` is host time only; these
tests count, without timing anything, that a repeated step neither plans, nor builds a kernel
key, nor parses its call key, nor traces again, that a new shape (or a new count of skipped
tokens) is decided afresh, and that the per-call shortcuts agree with the general path.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass.plan import _plan
from tile_pass.plan._plan import RegionCall
from tile_pass.program import _region, _token_weights
from tile_pass.tiles import tiled_region


def _loss(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _inputs(tokens, hidden=16, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).requires_grad_()
    return h, w, torch.randint(0, vocab, (tokens,), generator=g)


def _step(fn, h, w, y):
    loss = fn(h, w, y)
    grads = torch.autograd.grad(loss, [h, w])
    return loss, grads


def _assert_eager(compiled, h, w, y):
    loss, grads = _step(compiled, h, w, y)
    expected, expected_grads = _step(_loss, h, w, y)
    torch.testing.assert_close(loss, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.fixture
def counted(monkeypatch):
    """Calls of everything the per-call path must not repeat once a signature is known."""
    tile_pass.clear_caches()  # the first step below decides, whatever ran before in this process
    calls: collections.Counter[str] = collections.Counter()

    def count(owner, name):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    count(tiled_region, "plan_tiles")
    count(tiled_region, "_kernel_key")
    count(tiled_region, "_program_kernel")
    count(tiled_region, "_parsed")
    count(_token_weights, "_trace")
    monkeypatch.setattr(RegionCall, "parse", staticmethod(_counted_parse(calls)))
    return calls


def _counted_parse(calls):
    original = RegionCall.parse

    def parse(key):
        calls["RegionCall.parse"] += 1
        return original(key)

    return parse


@pytest.mark.parametrize("tokens", [64, 60])  # four full tiles; three and a short, padded one
def test_a_repeated_step_decides_nothing_again(counted, tokens):
    compiled = torch.compile(_loss, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    h, w, y = _inputs(tokens)
    _assert_eager(compiled, h, w, y)
    assert counted["plan_tiles"] and counted["_kernel_key"] and counted["_parsed"]  # the first step decides
    counted.clear()
    with _plan.recorded() as plans:
        for _ in range(3):
            _assert_eager(compiled, h, w, y)
    assert [(p.rows, p.num_tiles) for p in plans] == [(tokens, 4)] * 3
    assert not counted, f"repeated on a known signature: {dict(counted)}"


def test_a_new_shape_or_a_new_count_of_skipped_tokens_is_decided_afresh(counted):
    compiled = torch.compile(_loss, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    _assert_eager(compiled, *_inputs(64))
    counted.clear()
    h, w, y = _inputs(40, seed=1)
    with _plan.recorded() as plans:
        _assert_eager(compiled, h, w, y)
    assert [(p.rows, p.num_tiles) for p in plans] == [(40, 3)]
    assert counted["plan_tiles"] == 1
    y[::4] = -100  # ignored labels: the tiles run only the others, in fewer tiles
    counted.clear()
    with _plan.recorded() as plans:
        _assert_eager(compiled, h, w, y)
    assert [(p.rows, p.num_tiles) for p in plans] == [(30, 2)]
    assert counted["plan_tiles"] == 1


def test_a_plan_is_made_again_after_clear_caches(counted):
    compiled = torch.compile(_loss, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    h, w, y = _inputs(64)
    _assert_eager(compiled, h, w, y)
    tile_pass.clear_caches()
    counted.clear()
    _assert_eager(compiled, h, w, y)
    assert counted["plan_tiles"] == 1 and counted["_program_kernel"] == 1 and counted["_parsed"] == 1


def _program():
    """The registered program of the plain mean cross entropy of :func:`_inputs`, from a compile of it."""
    compiled = torch.compile(_loss, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    compiled(*_inputs(64))
    return next(
        p
        for p in map(_region.lookup, list(_region._programs))
        if p.form == "F.linear -> cross_entropy(ignore_index=-100)"
        and p.vocab_size == 40
        and p.outputs[0].dtype == torch.float64
    )


@pytest.mark.parametrize("value", [0.5, 0.0, -2.0, math.inf, math.nan])
@pytest.mark.parametrize("ignored", [(), (3,), tuple(range(0, 64, 2)), tuple(range(64))])
def test_a_broadcast_token_weight_skips_the_tokens_its_dense_copy_does(value, ignored):
    """The token weight of a mean is one value broadcast to every token; its flags are read from
    that value. They must skip exactly the tokens the same weight written out per token does."""
    program = _program()
    h, _, y = _inputs(64)
    y[list(ignored)] = -100
    broadcast = torch.tensor(value, dtype=torch.float64).expand(64)
    for values in (True, False):
        fast = tiled_region._skipped_rows(program, [y], h.detach(), {0: broadcast}, values)
        dense = tiled_region._skipped_rows(program, [y], h.detach(), {0: broadcast.clone()}, values)
        assert (fast is None) == (dense is None)
        if fast is not None:
            assert torch.equal(fast, dense)


def test_a_masked_output_with_a_broadcast_weight_skips_the_masked_tokens():
    """``masked_fill(mask, 0)`` zeroes a token where its bool mask is set; with a broadcast
    nonzero weight the mask alone decides, and it is read, never written."""
    program = _program()
    masked_zero = dataclasses.replace(program.outputs[0], zeros=_region.ZeroIf(0, _region.ZeroKind.TRUE))
    masked = dataclasses.replace(program, outputs=(masked_zero,))
    mask = torch.tensor([True] * 4 + [False] * 4)
    for value, expected in ((2.0, [4, 5, 6, 7]), (0.0, []), (math.inf, None)):
        weight = torch.tensor(value, dtype=torch.float64).expand(8)
        rows = tiled_region._skipped_rows(masked, [mask], torch.randn(8, 4), {0: weight}, True)
        assert (rows if rows is None else rows.tolist()) == expected
        assert mask.tolist() == [True] * 4 + [False] * 4


@pytest.mark.parametrize(
    ("labels", "ignore_index", "inside"),
    [
        ([0, 5, 9], None, True),
        ([0, 5, 10], None, False),
        ([-1, 5, 9], None, False),
        ([-100, 5, 9], -100, True),
        ([-100, -1, 9], -100, False),
        ([-100, 10, 9], -100, False),
        ([-100, -100], -100, True),
        ([10, 5], 10, True),  # an ignore_index inside the range is ignored too
    ],
)
def test_in_vocabulary_agrees_with_the_full_check(labels, ignore_index, inside):
    index = torch.tensor(labels)
    assert tiled_region._in_vocabulary(index, 10, ignore_index) is inside
    bad = (index < 0) | (index >= 10)
    if ignore_index is not None:
        bad &= index != ignore_index
    assert inside is not bool(bad.any())


def test_token_weights_do_not_compute_the_loss():
    """The derived gradient of a mean over labelled tokens reads the outputs' size only: the loss
    value that autograd's seed was shaped from is not computed each call."""
    program = _program()
    h, _, y = _inputs(64)
    y[:16] = -100
    outputs = [torch.zeros((), dtype=torch.float64).expand(64)]
    for _ in range(2):  # traced, then found by its sizes
        weights = _token_weights.token_weights(program, outputs, [h, y])
    # one value for every token (an ignored token's output is zero, not its weight)
    torch.testing.assert_close(weights[0], torch.full((64,), 1 / 48, dtype=torch.float64))
    sizes = (program.key, tuple((a.dtype, a.device.type, a.shape) for a in [*outputs, h, y]))
    graph = _token_weights._by_sizes.get(sizes).graph.graph
    first = next(n for n in graph.nodes if n.op == "placeholder")
    read = {user.target for user in first.users}
    assert read <= {torch.ops.aten.sym_size.int, torch.ops.aten.new_ones.default}, read
