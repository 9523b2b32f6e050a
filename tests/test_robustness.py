"""Bad and unusual input: every case either matches eager or raises at least as clearly.

``CASES`` lists every input tried, with its expected outcome for the tiled loss called
directly (``tile_pass.linear_cross_entropy``) and for the compiled rewrite (backend
"aot_eager" on ``F.cross_entropy(F.linear(h, w, b).float().view(-1, V), y.view(-1))``).
"match" means: same loss and gradients as eager, NaN/Inf exactly where eager has them (never
a finite wrong number), compared with a float64 eager oracle. ``docs/robustness.md`` holds
the same table; ``test_docs_table_is_current`` keeps them in sync.
"""

from __future__ import annotations

import pathlib
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_oracle

import tile_pass

V, H, N = 11, 8, 6
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "robustness.md"


@dataclass(frozen=True)
class Raises:
    """Expected error: its type and a fragment of its message (eager's own, where it has one)."""

    type: type
    fragment: str

    def __str__(self):
        return f"raises {self.type.__name__}: '{self.fragment}'"

    @property
    def pattern(self) -> str:
        """``fragment``, also matching ATen's older wording of it (torch < 2.13)."""
        older = OLDER_WORDING.get(self.fragment)
        return self.fragment if older is None else f"{self.fragment}|{older}"


#: ATen messages that torch < 2.13 words differently (2.11: "expected scalar type Long but found Int")
OLDER_WORDING = {"expected target dtype to be Long": "expected scalar type Long but found"}


MATCH = "matches eager"


@dataclass
class Case:
    name: str
    inputs: dict  # h, w, y, b (optional), reduction (optional), all float32/int64 unless stated
    direct: object  # MATCH or Raises
    compiled: object  # MATCH or Raises
    rewritten: bool | None = None  # whether the compiled pass fires (None: fails before it)
    eager: object = MATCH  # what plain eager does, for the table
    direct_bug: str | None = None  # an open tile_pass bug: the direct case is a strict xfail
    compiled_bug: str | None = None
    fixed: str | None = None  # a bug these tests found, since fixed (kept for the record)

    def __str__(self):
        return self.name


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def base(n=N, v=V, seed=0, **over):
    g = _g(seed)
    out = dict(
        h=torch.randn(n, H, generator=g),
        w=torch.randn(v, H, generator=g) / 2,
        y=torch.randint(0, v, (n,), generator=g),
        b=None,
        reduction="mean",
    )
    out.update(over)
    return out


def labels_with(value):
    y = base()["y"].clone()
    y[2] = value
    return y


def with_nonfinite(which, value):
    d = base()
    t = d[which].clone()
    t[1, 3] = value
    d[which] = t
    return d


def transposed_hidden():
    g = _g(1)
    return dict(base(), h=torch.randn(H, N, generator=g).t())  # [N, H], strides (1, N)


def transposed_weight():
    g = _g(2)
    return dict(base(), w=(torch.randn(H, V, generator=g) / 2).t())  # W2.t() of a [H, V] tensor


def strided_3d_hidden():
    g = _g(3)
    full = torch.randn(2, 2 * N, H, generator=g)
    return dict(base(), h=full[:, ::2], y=torch.randint(0, V, (2, N), generator=g))


OOB = Raises(IndexError, "out of bounds")

CASES = [
    Case("label == V", base(y=labels_with(V)), OOB, OOB, True, OOB),
    Case("label > V", base(y=labels_with(V + 50)), OOB, OOB, True, OOB),
    Case("label negative, not ignore_index (-3)", base(y=labels_with(-3)), OOB, OOB, True, OOB),
    Case(
        "labels int32",
        base(y=base()["y"].int()),
        Raises(RuntimeError, "expected target dtype to be Long"),
        Raises(RuntimeError, "expected target dtype to be Long"),
        False,
        Raises(RuntimeError, "expected target dtype to be Long"),
    ),
    Case(
        "labels float (class indices as float)",
        base(y=base()["y"].float()),
        Raises(RuntimeError, "expected target dtype to be Long"),
        Raises(RuntimeError, "Expected dtype int32/int64 for index"),  # Dynamo's fake run
        None,
        Raises(RuntimeError, "expected target dtype to be Long"),
    ),
    Case(
        "hidden H != weight H",
        base(h=torch.randn(N, H + 1)),
        Raises(RuntimeError, "cannot be multiplied"),
        Raises(RuntimeError, "must have same reduction dim"),
        None,
        Raises(RuntimeError, "cannot be multiplied"),
    ),
    Case(
        "bias of the wrong length",
        base(b=torch.randn(V + 1)),
        Raises(RuntimeError, "must match the existing size"),
        Raises(RuntimeError, "a dimension of length"),  # Dynamo's: broadcast (torch<2.15) or expand it
        None,
        Raises(RuntimeError, "must match the existing size"),
    ),
    Case(
        "labels shorter than tokens",
        base(y=base()["y"][:-1]),
        Raises(ValueError, "to match target batch_size"),
        Raises(RuntimeError, "batch_size"),
        None,
        Raises(ValueError, "to match target batch_size"),
    ),
    Case(
        "weight 1-D",
        base(w=torch.randn(H)),
        Raises(RuntimeError, "Expected floating point type for target"),  # eager's [N] "logits"
        Raises(RuntimeError, "is invalid for input of size"),
        None,
        Raises(RuntimeError, "is invalid for input of size"),
    ),
    Case("empty batch N=0, mean", base(n=0), MATCH, MATCH, True),
    Case("empty batch N=0, sum", base(n=0, reduction="sum"), MATCH, MATCH, True),
    Case("empty batch N=0, none", base(n=0, reduction="none"), MATCH, MATCH, True),
    Case("NaN in hidden", with_nonfinite("h", float("nan")), MATCH, MATCH, True),
    Case("+Inf in hidden", with_nonfinite("h", float("inf")), MATCH, MATCH, True),
    Case(
        "-Inf in hidden, sum", dict(with_nonfinite("h", float("-inf")), reduction="sum"), MATCH, MATCH, True
    ),
    Case("NaN in weight", with_nonfinite("w", float("nan")), MATCH, MATCH, True),
    Case("+Inf in weight", with_nonfinite("w", float("inf")), MATCH, MATCH, True),
    Case(
        "NaN in hidden, reduction none",
        dict(with_nonfinite("h", float("nan")), reduction="none"),
        MATCH,
        MATCH,
        True,
    ),
    Case("V=200000, N=3", base(n=3, v=200_000), MATCH, MATCH, True),
    Case("hidden a transposed view", transposed_hidden(), MATCH, MATCH, True),
    Case("weight = W2.t() of a [H, V] tensor", transposed_weight(), MATCH, MATCH, True),
    Case("hidden a strided 3-D slice", strided_3d_hidden(), MATCH, MATCH, True),
    Case(
        "weight bfloat16, hidden float32",
        base(w=base()["w"].bfloat16()),
        Raises(RuntimeError, "same dtype"),
        Raises(RuntimeError, "same dtype"),
        False,
        Raises(RuntimeError, "same dtype"),
    ),
    Case(
        "bias float64, hidden and weight float32",
        base(b=torch.randn(V, dtype=torch.float64)),
        Raises(RuntimeError, "dtype"),
        Raises(RuntimeError, "dtype"),
        False,
        Raises(RuntimeError, "dtype"),
    ),
    Case(
        "reduction='avg'",
        base(reduction="avg"),
        Raises(ValueError, "not a valid value for reduction"),
        Raises(RuntimeError, "not a valid value for reduction"),  # Dynamo's fake run, before the pass
        None,
        Raises(ValueError, "not a valid value for reduction"),
    ),
    Case(
        "label == ignore_index == V (all ignored, out of range)",
        base(y=torch.full((N,), V), ignore_index=V),
        MATCH,
        MATCH,
        True,
    ),
    Case(
        "labels uint8 (eager accepts Byte targets)",
        base(y=base()["y"].to(torch.uint8)),
        MATCH,
        Raises(RuntimeError, "Expected dtype int32/int64 for index"),  # plain torch.compile too
        None,
        fixed="uint8 targets failed inside the traced tile kernel with a fake-tensor gather error",
    ),
    Case(
        "ignore_index a float (2.7)",
        base(ignore_index=2.7),
        Raises(TypeError, "ignore_index"),
        Raises(TypeError, "must be int"),
        False,
        Raises(TypeError, "must be int"),
        fixed="ignore_index=2.7 was silently truncated to 2 by int(); eager raises TypeError",
    ),
    Case(
        "target [3, 2] for hidden [2, 3, H] (same count, other shape)",
        dict(base(), h=torch.randn(2, 3, H, generator=_g(4)), y=torch.randint(0, V, (3, 2), generator=_g(4))),
        Raises(ValueError, "shape"),
        MATCH,  # the canonical pattern flattens both with .view(-1) itself, as eager does
        True,
        fixed="target was flattened without checking target.shape == hidden.shape[:-1]: tokens "
        "silently paired with other tokens' labels (F.cross_entropy raises for mismatched batch shapes)",
    ),
    Case(
        "hidden size H = 0",
        dict(base(), h=torch.randn(N, 0), w=torch.randn(V, 0)),
        MATCH,
        MATCH,
        True,
        fixed="H=0 crashed with 'cannot reshape tensor of 0 elements into shape [-1, 0]', directly "
        "and (BackendCompilerFailed) in the rewritten graph; eager returns log(V)",
    ),
]


def canonical(h, w, y, b=None, reduction="mean", ignore_index=-100):
    """The pattern the compiled rewrite matches."""
    logits = F.linear(h, w, b).float().view(-1, w.shape[0])
    return F.cross_entropy(logits, y.view(-1), reduction=reduction, ignore_index=ignore_index)


def direct(h, w, y, b=None, reduction="mean", ignore_index=-100):
    return tile_pass.linear_cross_entropy(
        h, w, y, b, reduction=reduction, ignore_index=ignore_index, tile_tokens=4
    )


def oracle(h, w, y, b=None, reduction="mean", ignore_index=-100):
    """Eager on float64 copies: the reference for every "matches eager" case."""
    logits = F.linear(h, w, b)
    return F.cross_entropy(
        logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction, ignore_index=ignore_index
    )


def _leaves(d, dtype=None):
    """Fresh inputs that require grad; a view keeps its strides (as a view of a fresh leaf),
    ``dtype`` makes contiguous copies for the oracle."""
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            if dtype is not None:
                v = v.detach().to(dtype).requires_grad_()
            elif v._base is not None:
                base_leaf = v._base.detach().clone().requires_grad_()
                v = base_leaf.as_strided(v.shape, v.stride(), v.storage_offset())
            else:
                v = v.detach().clone().requires_grad_()
        out[k] = v
    return out


def _run(fn, d):
    """Loss and the gradients of every floating input (upstream: ones)."""
    out = fn(**d)
    wanted = [k for k, v in d.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    grads = torch.autograd.grad(out, [d[k] for k in wanted], torch.ones_like(out), allow_unused=True)
    return out.detach(), dict(zip(wanted, grads, strict=True))


def check(fn, case):
    expected = case.direct if fn is direct else case.compiled
    d = _leaves(case.inputs)
    if isinstance(expected, Raises):
        with pytest.raises(expected.type, match=expected.pattern):
            _run(fn, d)
        return
    out, grads = _run(fn, d)
    eager, eager_grads = _run(canonical, _leaves(case.inputs))
    ref, ref_grads = _run(oracle, _leaves(case.inputs, torch.float64))
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert_matches_eager(out, eager, ref, f"{case}: loss")
    for k, g in grads.items():
        assert g is not None, f"{case}: no gradient for {k}"
        assert g.shape == d[k].shape, k
        assert_matches_eager(g, eager_grads[k], ref_grads[k], f"{case}: grad {k}")


def assert_matches_eager(actual, eager, oracle, what):
    """NaN and +-Inf exactly where float32 eager has them; finite values within the float32
    tolerance of the float64 oracle, or within 2x eager's own error where that is larger
    (a sum over 200000 classes rounds more than the tolerance allows eager itself)."""
    actual, eager, oracle = (t.detach().double() for t in (actual, eager, oracle))
    assert torch.equal(actual.isnan(), eager.isnan()), f"{what}: NaN where eager has none, or hidden"
    assert torch.equal(actual.isinf(), eager.isinf()), f"{what}: Inf pattern differs from eager"
    assert torch.equal(actual[actual.isinf()], eager[eager.isinf()]), f"{what}: Inf sign differs"
    finite = actual.isfinite()
    if not finite.any():
        return
    a, e, o = actual[finite], eager[finite], oracle[finite]
    eager_err = (e - o).abs().max().item() if o.isfinite().all() else 0.0
    try:
        assert_close_to_oracle(a, o, torch.float32, what)
    except AssertionError:
        assert (a - o).abs().max().item() <= 2 * eager_err, f"{what}: worse than 2x eager's own error"


def _params(bug_field):
    out = []
    for c in CASES:
        bug = getattr(c, bug_field)
        marks = [pytest.mark.xfail(strict=True, reason=f"bug: {bug}")] if bug else []
        out.append(pytest.param(c, marks=marks, id=c.name))
    return out


@pytest.mark.parametrize("case", _params("direct_bug"))
def test_direct(case):
    check(direct, case)


@pytest.mark.parametrize("case", _params("compiled_bug"))
def test_compiled(case):
    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    compiled = torch.compile(canonical, backend=backend)
    check(compiled, case)
    report = backend.report()
    if case.rewritten is not None:
        assert bool(report.rewrites) == case.rewritten, str(report)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_eager_column_is_true(case):
    """The table's "eager" column is checked, so the comparison claims are honest."""
    d = _leaves(case.inputs)
    if isinstance(case.eager, Raises):
        with pytest.raises(case.eager.type, match=case.eager.pattern):
            _run(canonical, d)
    else:
        _run(canonical, d)


@pytest.mark.parametrize("fn", ["direct", "compiled"])
def test_two_threads_concurrently(fn):
    """The same call from two threads at once (a shape never traced before, so both threads
    race to build the tile kernel / the compiled graph) equals the single-threaded result."""
    d = base(n=37, v=23, seed=7)
    call = direct
    if fn == "compiled":
        call = torch.compile(canonical, backend=tile_pass.backend("aot_eager", tile_tokens=4))
    barrier = threading.Barrier(2)
    results, errors = [None, None], []

    def worker(i):
        try:
            barrier.wait(timeout=30)
            results[i] = _run(call, _leaves(d))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    single = _run(call, _leaves(d))
    for out, grads in results:
        torch.testing.assert_close(out, single[0], rtol=0, atol=0)
        for k, g in grads.items():
            torch.testing.assert_close(g, single[1][k], rtol=0, atol=0)
    ref, _ = _run(oracle, _leaves(d, torch.float64))
    assert_close_to_oracle(single[0], ref, torch.float32, "threaded loss vs oracle")
    # FX's process-global tracing state is left as it was (a race here made every later
    # compile in the process fail with "symbolically trace a dynamo-optimized function").
    assert not torch.fx._symbolic_trace.is_fx_tracing()


def test_tile_tracing_waits_for_a_compile_in_another_thread():
    """Tracing a tile at run time takes Dynamo's compile lock, so it never interleaves FX's
    global tracing state with a compile running in another thread."""
    from torch._dynamo.convert_frame import compile_lock

    tile_pass.clear_caches()  # the call below must trace its tile
    d = base(n=9, v=31, seed=5)
    compiling, compiled = threading.Event(), threading.Event()

    def another_thread_compiles():
        with compile_lock:
            compiling.set()
            compiled.wait(30)

    holder = threading.Thread(target=another_thread_compiles)
    holder.start()
    assert compiling.wait(30)
    results = []
    caller = threading.Thread(target=lambda: results.append(_run(direct, _leaves(d))))
    caller.start()
    caller.join(timeout=3)
    traced_during_the_compile = not caller.is_alive()
    compiled.set()
    holder.join(30)
    caller.join(120)
    assert not traced_during_the_compile
    assert len(results) == 1
    ref, _ = _run(oracle, _leaves(d, torch.float64))
    assert_close_to_oracle(results[0][0], ref, torch.float32, "loss traced after the compile")


def test_meta_tensors_give_eager_shape():
    """Shape inference on the meta device (e.g. models built under torch.device("meta")).
    Found by these tests: meta tensors raised 'unknown device type for autocast' (fixed)."""
    d = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in base().items()}
    out = direct(**d)
    assert out.device.type == "meta" and out.shape == canonical(**d).shape


def outcome_table() -> str:
    rows = [
        "| input | eager | `linear_cross_entropy` | compiled rewrite | pass fires |",
        "|---|---|---|---|---|",
    ]
    for c in CASES:
        fires = {True: "yes", False: "no (skipped, reported)", None: "no (Dynamo fails first)"}[c.rewritten]
        bug = " **(open bug: today it does not)**"
        direct_s = f"{c.direct}{bug if c.direct_bug else ''}{' (was a bug, fixed)' if c.fixed else ''}"
        compiled_s = f"{c.compiled}{bug if c.compiled_bug else ''}"
        rows.append(f"| {c.name} | {c.eager} | {direct_s} | {compiled_s} | {fires} |")
    return "\n".join(rows) + "\n"


def test_docs_table_is_current():
    assert outcome_table() in DOCS.read_text(), (
        "regenerate docs/robustness.md: python tests/test_robustness.py"
    )


if __name__ == "__main__":
    print(outcome_table())
