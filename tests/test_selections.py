"""Selections of the logits' token rows, however nested: each is one selection of the tiles' rows.

A slice of a slice, chunks of a token slice, chunks of rows that were regrouped (squeezed or
flattened), complementary slices read by separate terms, a slice that covers every row, and a
permutation of the token dimensions all compose into one index map of the hidden states' rows:
the tiles compute every row once, and each reader reads its rows of the tiles' values. Each
case is rewritten (one region, nothing skipped) and exact against float64 eager, loss and the
gradients of the hidden states and the head's weight, at the default tile and a small one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads

import tile_pass
from tile_pass.program._row_selection import RowSelection, SelectionOp, row_map, same_rows
from tile_pass.program._token_layout import select, spread

B, T, H, V = 2, 9, 16, 37  # V prime: a vocabulary no tile size divides
SMALL_TILE = 4
CTX = 3  # a prompt's length: the response's logits are [:, CTX - 1 : -1]


def _chain(*ops) -> RowSelection:
    selection = RowSelection()
    for op, argument in ops:
        selection = selection.then(op, argument)
    return selection


def _at(*index):
    return SelectionOp.INDEX, index


ALL = slice(None)
FLAT = (SelectionOp.FLATTEN, None)

#: nested selections as the user writes them on a [2, 9] token grid, and the same chain of ops
NESTED = [
    (lambda x: x[:, 2:-1][1:2], _chain(_at(ALL, slice(2, -1)), _at(slice(1, 2), ALL))),
    (
        lambda x: x[:, 1:][:, :-2][1:],
        _chain(_at(ALL, slice(1, None)), _at(ALL, slice(-2)), _at(slice(1, None), ALL)),
    ),
    (lambda x: x[:, :-1].reshape(-1)[4:8], _chain(_at(ALL, slice(-1)), FLAT, _at(slice(4, 8)))),
    (lambda x: x.reshape(-1)[16:24], _chain(FLAT, _at(slice(16, 24)))),  # the last chunk short
    (lambda x: x[:, 0], _chain(_at(ALL, 0))),
    (
        lambda x: x.transpose(0, 1)[3:].reshape(-1)[::2],
        _chain((SelectionOp.PERMUTE, (1, 0)), _at(slice(3, None), ALL), FLAT, _at(slice(None, None, 2))),
    ),
]


@pytest.mark.parametrize("case", range(len(NESTED)))
def test_a_nested_selection_is_one_map_of_the_rows(case):
    """The chain replayed on the row numbers picks the rows indexing the tensor itself picks."""
    index, selection = NESTED[case]
    numbers = torch.arange(2 * 9).view(2, 9)
    hidden = torch.zeros(2, 9, 3)
    assert torch.equal(row_map(hidden, selection), index(numbers))


def test_selections_of_the_same_rows_are_the_same_selection():
    tokens = (2, 9)
    a = _chain(_at(ALL, slice(-1)), _at(slice(1, None), ALL))
    b = _chain(_at(slice(1, None), slice(-1)))
    assert same_rows(a, b, tokens)
    assert not same_rows(a, _chain(_at(slice(1, None), slice(1, None))), tokens)
    assert same_rows(a, a, (2, object())) and not same_rows(a, b, (2, object()))  # sizes unknown: by ops


def test_spread_then_select_gives_the_operand_back():
    """A selection's per-token operand written into the tiles' rows and read back at them."""
    _, selection = NESTED[2]
    hidden = torch.zeros(2, 9, 3)
    x = torch.arange(4.0) + 10
    full = spread(x, hidden, True, 0, selection)
    assert full.shape == (18,) and torch.equal(select(full, hidden, selection), x)
    assert torch.equal(full[row_map(hidden, selection)], x)
    rows = torch.randn(4, 5)  # rows of a [V] part
    assert torch.equal(select(spread(rows, hidden, True, 1, selection), hidden, selection), rows)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1) - (logits.softmax(-1) * logits).sum(-1)


def _token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.gather(logits.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)


def complementary_halves(h, w, y):
    """DPO's chosen and rejected halves (``logits[:B]``, ``logits[B:]``), each read by its own
    helper: together they cover every row."""
    logits = h @ w.t()
    half = logits.shape[0] // 2
    chosen = _token_log_probs(logits[:half], y[:half]).sum(-1)
    rejected = (
        logits[half:].gather(-1, y[half:].unsqueeze(-1)).squeeze(-1) - logits[half:].logsumexp(-1)
    ).sum(-1)
    return -F.logsigmoid(0.1 * (chosen - rejected)).mean()


def _chunked_logsumexp(chunk: int):
    """OpenRLHF's ``_logsumexp_by_chunk``: the rows' log-sum-exp by chunks of ``chunk`` rows,
    written into a zero buffer; the chunks together cover every row."""

    def loss(h, w, y):
        logits = h @ w.t()
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.zeros(flat.shape[0], dtype=flat.dtype)
        for start in range(0, flat.shape[0], chunk):
            stop = min(start + chunk, flat.shape[0])
            lse[start:stop] = torch.logsumexp(flat[start:stop], dim=-1)
        picked = torch.gather(logits, -1, y.unsqueeze(-1)).squeeze(-1)
        return -(picked - lse.view(y.shape)).mean()

    return loss


#: one chunk longer than the sequence (the one slice ``[0:N]`` covers every row), and chunks of
#: 5 rows, the last one short
chunked_logsumexp_one_chunk = _chunked_logsumexp(1024)
chunked_logsumexp_many_chunks = _chunked_logsumexp(5)


def batch_slices_of_a_token_slice(h, w, y):
    """torchtune's GRPO with ``batched_logits_to_logprobs``: the response's logits
    (``[:, CTX - 1 : -1]``), then a slice of one sequence each, concatenated."""
    logits = (h @ w.t())[:, CTX - 1 : -1]
    ids = y[:, CTX:]
    per_token = torch.cat([_token_log_probs(logits[i : i + 1] / 0.7, ids[i : i + 1]) for i in range(B)])
    return -per_token.mean()


def slice_of_a_slice(h, w, y):
    """A slice of a slice of a slice, read beside all rows (so no slice moves onto the hidden
    states): ``logits[:, 1:][:, :-2][1:]``."""
    logits = h @ w.t()
    inner = logits[:, 1:][:, :-2][1:]
    return _entropy(logits).mean() + _token_log_probs(inner, y[1:, 1:-2]).sum()


def chunks_of_a_flat_token_slice(h, w, y):
    """Chunks of 4 rows of the flattened response logits (``[:, :-1].reshape(-1, V)``), each
    with its own entropy, written into a buffer, beside the log-probs of every response token."""
    logits = (h @ w.t())[:, :-1]
    flat = logits.reshape(-1, logits.shape[-1])
    ent = torch.zeros(flat.shape[0])
    for start in range(0, flat.shape[0], 4):
        ent[start : start + 4] = _entropy(flat[start : start + 4])
    lp = _token_log_probs(logits, y[:, 1:])
    return -(lp.mean() + 0.01 * ent.mean())


def chunks_of_squeezed_rows(h, w, y):
    """verl's remove-padding path with ``entropy_from_logits_with_chunking``: the packed sequence
    ``[1, nnz, V]`` squeezed to ``[nnz, V]`` (a regrouping), then chunks of 8 rows of it."""
    logits = (h.reshape(1, -1, h.shape[-1]) @ w.t()).squeeze(0) / 0.7
    ids = y.reshape(-1)
    ent = torch.zeros(logits.shape[0])
    for start in range(0, logits.shape[0], 8):
        chunk = logits[start : start + 8].float()
        ent[start : start + 8] = _entropy(chunk)
    lp = _token_log_probs(logits, ids)
    return -(lp.mean() + 0.01 * ent.mean())


def ngram_streams(h, w, y):
    """ProphetNet's n-gram streams: logits ``[B, n, T, V]``, the main stream ``[:, 0]`` and the
    others ``[:, 1:]`` (complementary slices on the n-gram axis) returned, and the loss on the
    streams moved to the front (``transpose(0, 1).contiguous().view(-1, V)``)."""
    streams = h.view(B, 2, -1, h.shape[-1]) @ w.t()  # the hidden states of each stream
    main, others = streams[:, 0], streams[:, 1:]
    lprobs = F.log_softmax(
        streams.transpose(0, 1).contiguous().view(-1, w.shape[0]), dim=-1, dtype=torch.float32
    )
    targets = y.new_full((2, B, streams.shape[2]), -100)
    targets[0], targets[1] = y[:, : streams.shape[2]], y[:, : streams.shape[2]]
    return F.nll_loss(lprobs, targets.view(-1)), main, others


def selection_beside_a_token_slice(h, w, y):
    """The response's log-probs (``logits[:, 2:]``) beside the first sequence's entropy over all
    its rows (``logits[:1]``, a selection of rows the slice drops): no slice moves."""
    logits = h @ w.t()
    picked = _token_log_probs(logits[:, 2:], y[:, 2:]).sum()
    return -picked + 0.01 * _entropy(logits[:1]).sum()


def buffer_written_then_read(h, w, y):
    """The log-sum-exps written into a buffer (``lse[:, :] = ...``), then the buffer read beside the
    logits: the reader takes values computed from the logits outside the tiles, so it stays in the
    graph (the tiles would otherwise read the buffer before the write)."""
    logits = h @ w.t()
    lse = torch.zeros(y.shape)
    lse[:, :] = logits.logsumexp(-1)
    picked = torch.gather(logits, -1, y.unsqueeze(-1)).squeeze(-1)
    return -(picked - lse).mean()


def per_token_values_of_different_selections_combined(h, w, y):
    """The fix the refusal names: each selection reduced first, the per-token values combined."""
    logits = h @ w.t()
    return (logits[:1].logsumexp(-1) - logits[1:].logsumexp(-1)).exp().mean() + _entropy(logits).mean()


CASES = [
    complementary_halves,
    chunked_logsumexp_one_chunk,
    chunked_logsumexp_many_chunks,
    batch_slices_of_a_token_slice,
    slice_of_a_slice,
    chunks_of_a_flat_token_slice,
    chunks_of_squeezed_rows,
    ngram_streams,
    selection_beside_a_token_slice,
    buffer_written_then_read,
    per_token_values_of_different_selections_combined,
]


def _inputs(fn, device):
    g = torch.Generator().manual_seed(0)
    tokens = 2 * T if fn is ngram_streams else T
    h = torch.randn(B, tokens, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (B, tokens), generator=g)
    return [t.to(device) for t in (h, w, y)]


def _loss(fn):
    def loss(h, w, y):
        out = fn(h, w, y)
        if isinstance(out, tuple):  # returned rows: their values are checked, the gradient is the loss's
            return out[0] + sum(0.0 * o.detach().sum() for o in out[1:])
        return out

    return loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [None, SMALL_TILE], ids=["default-tile", "small-tile"])
@pytest.mark.parametrize("fn", CASES, ids=[f.__name__ for f in CASES])
def test_selection_is_tiled_and_exact(fn, tile, device):
    h, w, y = _inputs(fn, device)
    settings = {} if tile is None else {"tile_tokens": tile}
    backend = tile_pass.backend("aot_eager", **settings)
    compiled = torch.compile(fn, backend=backend)
    out, grads = value_and_grads(_loss(compiled), leaves(h, w, y))
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    oracle, oracle_grads = value_and_grads(_loss(fn), leaves(h, w, y, dtype=torch.float64))
    assert_close_to_oracle(out, oracle, torch.float32, f"{fn.__name__} loss")
    for grad, ref, what in zip(grads, oracle_grads, ("dh", "dw"), strict=False):
        assert_close_to_oracle(grad, ref, torch.float32, f"{fn.__name__} {what}")
    returned = compiled(*leaves(h, w, y))
    if isinstance(returned, tuple):  # the rows it returns, exact too
        for got, ref in zip(returned[1:], fn(*leaves(h, w, y, dtype=torch.float64))[1:], strict=True):
            assert_close_to_oracle(got.detach(), ref.detach(), torch.float32, f"{fn.__name__} returned rows")


@pytest.mark.parametrize("fn", [buffer_written_then_read, chunked_logsumexp_many_chunks])
def test_a_buffer_written_with_the_region_values_is_read_after_the_write(fn):
    """Without a gradient too (no saved tensor's version to trip over), the value read from the
    buffer is the written one."""
    h, w, y = _inputs(fn, "cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(h, w, y)
        oracle = fn(h.double(), w.double(), y)
    assert len(backend.report().rewrites) == 1, str(backend.report())
    assert_close_to_oracle(out, oracle, torch.float32, fn.__name__)


def test_nested_selections_are_reported_as_one_selection_each():
    h, w, y = _inputs(slice_of_a_slice, "cpu")
    report = tile_pass.explain(slice_of_a_slice, h, w, y)
    assert "row selections [:, 1:][:, :-2][1:]" in report.rewrites[0].form, str(report)


def test_chunks_of_one_computation_run_it_once_per_row():
    """Each chunk of a chunked loop is the same op on the same rows: the tiles compute it once
    (one softmax for every chunk's entropy, beside the log-probabilities' log_softmax)."""
    h, w, y = _inputs(chunks_of_squeezed_rows, "cpu")
    form = tile_pass.explain(chunks_of_squeezed_rows, h, w, y).rewrites[0].form
    assert form.count("softmax") == 2 and "row selections .flatten()[0:8], .flatten()[8:16]" in form, form


def different_selections_combined(h, w, y):
    logits = h @ w.t()
    first, second = logits[:1], logits[1:]
    return (first.log_softmax(-1) - second.log_softmax(-1)).exp().mean() + _entropy(logits).mean()


def test_values_of_different_selections_combined_are_refused_with_the_reason():
    """``logits[:1] - logits[1:]`` pairs rows that are not the tiles' same rows: skipped, named."""
    h, w, y = _inputs(different_selections_combined, "cpu")
    report = tile_pass.explain(different_selections_combined, h, w, y)
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    reason = report.skipped[0].reason
    assert "`sub` at test_selections.py:" in reason and "combines values of different selections" in reason, (
        reason
    )
    assert "fix: reduce each selection over the vocabulary first" in reason, reason
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    out, grads = value_and_grads(
        torch.compile(different_selections_combined, backend=backend), leaves(h, w, y)
    )
    oracle, oracle_grads = value_and_grads(
        different_selections_combined, leaves(h, w, y, dtype=torch.float64)
    )
    assert_close_to_oracle(out, oracle, torch.float32, "loss")
    for grad, ref in zip(grads[:2], oracle_grads[:2], strict=True):
        assert_close_to_oracle(grad, ref, torch.float32, "grad")


def test_chunks_of_a_token_slice_run_only_the_sliced_rows():
    """The response's slice moves onto the hidden states; the chunks of it are selections of its rows."""
    h, w, y = _inputs(batch_slices_of_a_token_slice, "cpu")
    rewrite = tile_pass.explain(batch_slices_of_a_token_slice, h, w, y).rewrites[0]
    assert rewrite.num_tokens == B * (T - CTX), rewrite.form
    assert "slice tokens" in rewrite.form and "row selections [0:1], [1:2]" in rewrite.form, rewrite.form


@pytest.mark.parametrize("chunk_size", [1024, 5], ids=["one-chunk-covers-every-row", "chunks-of-5"])
def test_openrlhf_logsumexp_by_chunk_is_tiled_and_exact(chunk_size):
    """OpenRLHF's own ``_logsumexp_by_chunk`` (its ``log_probs_from_logits`` without flash-attn),
    beside the labels' logits: each chunk's slice of the flattened rows is a selection (one that
    covers every row is none), written into OpenRLHF's buffer, which the loss then reads."""
    try:
        import rl_steps

        utils = rl_steps.openrlhf().utils
    except ImportError:
        pytest.skip("openrlhf is not installed")

    def step(h, w, y):
        logits = h @ w.t()
        lse = utils._logsumexp_by_chunk(logits.reshape(-1, logits.shape[-1]), chunk_size=chunk_size)
        picked = torch.gather(logits, -1, y.unsqueeze(-1)).squeeze(-1)
        return -(picked - lse.view(y.shape)).mean()

    h, w, y = _inputs(step, "cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    out, grads = value_and_grads(torch.compile(step, backend=backend), leaves(h, w, y))
    assert len(backend.report().rewrites) == 1 and not backend.report().skipped, str(backend.report())
    oracle, oracle_grads = value_and_grads(step, leaves(h, w, y, dtype=torch.float64))
    assert_close_to_oracle(out, oracle, torch.float32, "loss")
    for grad, ref in zip(grads[:2], oracle_grads[:2], strict=True):
        assert_close_to_oracle(grad, ref, torch.float32, "grad")
