"""The package's caches are of one kind (tile_pass._caches.BoundedCache), bounded, and all emptied by
``tile_pass.clear_caches()``; the program registry forgets programs, but never one a live compiled
graph runs."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass import _caches, _textbook
from tile_pass.plan import _plan
from tile_pass.program import _region, _token_groups, _token_summaries, _token_weights
from tile_pass.tiles import _tile_kernel


def _loss(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _z_loss(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits, y) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    return h, w, torch.randint(0, 40, (12,), generator=g)


def _step(fn, inputs):
    loss = fn(*inputs)
    return [loss.detach(), *torch.autograd.grad(loss, inputs[:2])]


def _compiled(fn):
    return torch.compile(fn, backend=tile_pass.backend("aot_eager", tile_tokens=4, compile_tiles=False))


def test_every_cache_is_one_kind_and_registered():
    caches = {
        "programs": _region._programs,
        "plans": _plan._plans,
        "tile functions": _tile_kernel._cache,
        "compiled plane kernels": _tile_kernel._compiled_adds,
        "token weights": _token_weights._derived,
        "token weights by sizes": _token_weights._by_sizes,
        "token groups": _token_groups._cache,
        "token summaries": _token_summaries._cache,
        "textbook graphs": _textbook._graphs,
    }
    registered = _caches.registered()
    for name, cache in caches.items():
        assert isinstance(cache, _caches.BoundedCache), name
        assert any(cache is r for r in registered), name
        assert cache.limit > 0, name


def test_clear_caches_empties_every_registered_cache_and_a_compiled_step_still_runs():
    torch._dynamo.reset()
    h, w, y = _inputs()
    compiled = _compiled(_z_loss)
    expected = _step(_z_loss, (h, w, y))
    torch.testing.assert_close(_step(compiled, (h, w, y)), expected)
    tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4)
    filled = [cache for cache in _caches.registered() if len(cache)]
    for cache in (_region._programs, _plan._plans, _tile_kernel._cache, _textbook._graphs):
        assert cache in filled, cache
    tile_pass.clear_caches()
    assert [cache for cache in _caches.registered() if len(cache)] == []
    # the compiled graph holds its program: it runs on (and fills the caches again)
    torch.testing.assert_close(_step(compiled, (h, w, y)), expected)
    assert len(_tile_kernel._cache) and len(_plan._plans)


def test_a_bounded_cache_evicts_the_least_recently_used():
    cache = _caches.BoundedCache("test lru", 2)
    for i in range(5):
        cache.put(i, str(i))
    assert cache.get(3) == "3"
    cache.put(5, "5")
    assert list(cache) == [3, 5] and cache.get(0) is None and cache.get(4) is None
    assert cache.setdefault(3, "other") == "3" and cache.setdefault(6, "6") == "6"
    assert list(cache) == [3, 6]


def test_a_registry_cache_finds_an_evicted_value_while_it_is_held():
    class Value:
        pass

    cache = _caches.BoundedCache("test registry", 1, find_while_referenced=True)
    held = cache.put("held", Value())
    cache.put("dropped", Value())
    cache.put("third", Value())  # evicts both from the bounded part
    gc.collect()
    assert len(cache) == 1
    assert cache.get("held") is held  # something holds it: still found
    assert cache.get("dropped") is None  # nothing does: forgotten
    cache.clear()
    assert len(cache) == 0 and cache.get("held") is held


def test_the_program_registry_evicts_programs_no_live_graph_holds(monkeypatch):
    """With room for one program, compiling a second region evicts the first from the registry's
    bounded part; the first compiled graph still runs (it holds its program), and once that graph
    and the run-time caches that hold it are gone, so is its program."""
    monkeypatch.setattr(_region._programs, "limit", 1)
    torch._dynamo.reset()
    tile_pass.clear_caches()
    inputs = _inputs(1)
    first, second = _compiled(_loss), _compiled(_z_loss)
    expected = _step(_loss, inputs)
    torch.testing.assert_close(_step(first, inputs), expected)
    (first_key,) = list(_region._programs)
    torch.testing.assert_close(_step(second, inputs), _step(_z_loss, inputs))
    assert first_key not in list(_region._programs) and len(_region._programs) == 1
    torch.testing.assert_close(_step(first, inputs), expected)  # evicted, yet found: its graph holds it
    del first, second
    torch._dynamo.reset()
    gc.collect()
    tile_pass.clear_caches()  # the run-time caches (a loop plan per shape) hold their program too
    with pytest.raises(RuntimeError, match="is not registered in this process"):
        _region.lookup(first_key)


def test_a_trace_on_the_tracing_thread_may_ask_for_another():
    assert _caches.on_tracing_thread(lambda: _caches.on_tracing_thread(lambda: 7)) == 7
