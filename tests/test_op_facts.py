"""Every fact about one op in one place (``tile_pass.program._op_facts``), on one key per op.

An op added with one registration next to its rule (``torch.special.xlog1py``: a zero rule,
a linearity fact, a report name) is tiled and exact against float64 eager; a registration
that forgets a fact raises at once; every way Dynamo spells an op reaches the same facts.
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_oracle, leaves, value_and_grads

import tile_pass
from tile_pass.program import _op_facts, _region
from tile_pass.program._op_facts import AS_KEY, FACT_NAMES, FACTS, Fold, Linear, RuleKind

N, H, V, TILE = 40, 16, 53, 8


def unlikelihood(h, w, y, negative, mask):
    """Cross entropy plus a masked unlikelihood term: ``-mask * log(1 - p(negative))``."""
    logits = F.linear(h, w)
    p_negative = logits.softmax(-1).gather(-1, negative.unsqueeze(-1)).squeeze(-1)
    return F.cross_entropy(logits, y) - torch.special.xlog1py(mask, -p_negative).mean()


def log_weighted_ce(h, w, y, negative, mask):
    """Per-token cross entropies weighted by ``log1p(mask)`` after the region (linear in them)."""
    per_token = F.cross_entropy(F.linear(h, w), y, reduction="none")
    return torch.special.xlog1py(per_token, mask).sum() / N


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    negative = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.3).float()
    return h, w, y, negative, mask


@pytest.mark.parametrize("fn", [unlikelihood, log_weighted_ce])
def test_a_new_op_registered_once_is_tiled_and_exact(fn):
    """``xlog1py`` is one registration (``tile_pass/match/_elementwise_rules.py``): in the region
    (its zero rule makes a masked token skippable) and in the scalar loss after it (its linearity
    joins it to the op); the report names it; loss and gradients are float64 eager's over several
    tiles."""
    h, w, y, negative, mask = _inputs()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    out, grads = value_and_grads(compiled, [*leaves(h, w), y, negative, mask])
    oracle, oracle_grads = value_and_grads(fn, [*leaves(h, w, dtype=torch.float64), y, negative, mask])
    assert_close_to_oracle(out, oracle, torch.float32, "loss")
    for name, got, want in zip(("h", "w"), grads, oracle_grads, strict=False):
        assert_close_to_oracle(got, want, torch.float32, f"d{name}")
    (rewrite,) = backend.report().rewrites
    assert "one scalar loss" in rewrite.reduction, rewrite.reduction
    if fn is unlikelihood:
        assert "xlog1py" in rewrite.form, rewrite.form
        step = _region.Step(
            "call_function", torch.special.xlog1py, (_region.Ref(_region.RefKind.TOKEN, 1), 0.5)
        )
        assert _region.zero_where(step, {}, frozenset({1})) == _region.ZeroIf(
            1, _region.ZeroKind.ZERO, exact=False
        )
        assert step.describe() == "xlog1py(0.5)"


def _facts_of(key: str) -> dict:
    return {name: getattr(FACTS[key], name) for name in FACT_NAMES}


def test_a_registration_that_forgets_a_fact_raises():
    facts = {**_facts_of("exp"), "shown": AS_KEY}
    for forgotten in ("zeros", "linear", "shown", "sharded", "folds"):
        partial = {k: v for k, v in facts.items() if k != forgotten}
        with pytest.raises(TypeError, match=f"missing \\['{forgotten}'\\]"):
            _op_facts.register_ops("softsign", kind=RuleKind.ELEMENTWISE, **partial)
    with pytest.raises(TypeError, match="unknown"):
        _op_facts.register_ops("softsign", kind=RuleKind.ELEMENTWISE, colour="blue", **facts)
    with pytest.raises(TypeError, match="linear"):
        _op_facts.register_ops("softsign", kind=RuleKind.ELEMENTWISE, **{**facts, "linear": True})(print)
    with pytest.raises(ValueError, match="classify"):  # a rule kind without its rule
        _op_facts.register_ops("softsign", kind=RuleKind.ELEMENTWISE, **facts)(None)
    assert "softsign" not in FACTS
    assert FACTS["exp"].folds is Fold.ALWAYS and FACTS["mul"].linear is Linear.FACTOR


@pytest.mark.parametrize(
    "key, spellings",
    [
        ("add", [torch.add, operator.add, "add", "__add__", "__radd__", operator.iadd, "add_", "__iadd__"]),
        ("div", [torch.div, torch.true_divide, operator.truediv, "div", "true_divide", "__truediv__",
                 operator.itruediv, "div_"]),
        ("rdiv", ["__rtruediv__"]),
        ("rsub", [torch.rsub, "__rsub__"]),
        ("mul", [torch.mul, operator.mul, "mul", "__mul__", "__rmul__", operator.imul, "mul_"]),
        ("logsumexp", [torch.logsumexp, torch.special.logsumexp, "logsumexp"]),
        ("log_softmax", [F.log_softmax, torch.log_softmax, torch.special.log_softmax, "log_softmax"]),
        ("xlog1py", [torch.special.xlog1py]),
        ("logsigmoid", [F.logsigmoid]),
        ("getitem", [operator.getitem, "__getitem__"]),
    ],
)  # fmt: skip
def test_every_spelling_of_an_op_maps_to_one_key(key, spellings):
    assert {_op_facts.op_key(s) for s in spellings} == {key}
    assert {id(_op_facts.facts_for(s)) for s in spellings} == {id(FACTS[key])}
    inplace = [s for s in spellings if _op_facts.spelling(s).inplace]
    assert all(_op_facts.spelling(s).out_of_place in spellings for s in inplace)


def test_targets_outside_torch_have_no_key():
    assert _op_facts.op_key(max) is None and _op_facts.op_key(abs) is None  # builtins, not torch's
    assert _op_facts.op_key([1]) is None  # unhashable
    assert _op_facts.facts_for("no_such_op") is None


def test_every_sharded_form_is_a_function_given_at_registration():
    """An op's ``sharded`` fact is its group-wide function itself, resolved when the op is
    registered: a name to be looked up when a region is matched, or anything else that cannot
    be called, raises at registration."""
    sharded = {key: facts.sharded for key, facts in FACTS.items() if facts.sharded is not None}
    assert {"sum", "mean", "logsumexp", "softmax", "log_softmax", "gather", "cross_entropy"} <= sharded.keys()
    assert all(callable(function) for function in sharded.values()), sharded
    assert all(FACTS[key].kind.over_vocab for key in sharded), "only an op over the vocabulary needs one"
    facts = {**_facts_of("logsumexp"), "shown": AS_KEY}
    for bad in ("shard_logsumexp", 3):
        with pytest.raises(TypeError, match="sharded"):
            _op_facts.register_ops("softsign", kind=RuleKind.VOCAB_REDUCTION, **{**facts, "sharded": bad})(
                print
            )
    assert "softsign" not in FACTS


def test_a_reduction_binds_its_arguments_by_its_signature_fact():
    """The signature a rule binds a node's arguments with is a fact of the op (``sum``'s ``dim``,
    ``keepdim`` and ``dtype``), checked at registration like the others."""
    assert list(FACTS["sum"].signature.parameters) == ["input", "dim", "keepdim", "dtype"]
    assert FACTS["logsumexp"].signature.parameters["dim"].default is inspect.Parameter.empty
    assert FACTS["max"].signature is FACTS["argmin"].signature and FACTS["exp"].signature is None
    facts = {**_facts_of("logsumexp"), "shown": AS_KEY}
    with pytest.raises(TypeError, match="signature"):
        _op_facts.register_ops("softsign", kind=RuleKind.VOCAB_REDUCTION, **{**facts, "signature": "dim"})(
            print
        )
    assert "softsign" not in FACTS


def test_the_op_facts_are_the_programs_vocabulary():
    """The facts live in program/ (the IR's ground floor): nothing in program/ and nothing in the
    distributed module imports the matcher, function-level imports included."""
    from test_layout import import_graph

    graph = import_graph()
    upward = {
        (module, imported)
        for module, imports in graph.items()
        if module.startswith("tile_pass.program") or module == "tile_pass._distributed"
        for imported in imports
        if imported.startswith("tile_pass.match")
    }
    assert upward == set(), upward
    assert "tile_pass.program._op_facts" in graph["tile_pass.program._region"]
