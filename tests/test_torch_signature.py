"""``tile_pass.linear_cross_entropy`` as a drop-in for torch's ``F.linear_cross_entropy``:
the same argument names and meanings (``weight`` = class weights, ``linear_bias``,
``ignore_index=None``), class-probability targets, and the pass matching class weights and
probability targets in a graph, all exact against float64 eager."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle

import tile_pass

N, H, V = 23, 8, 13
#: torch 2.13 has F.linear_cross_entropy; 2.11 does not (there its reference definition stands in)
HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy")


def torch_linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, **kwargs):
    if HAS_TORCH_LCE:
        return F.linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, **kwargs)
    return F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, **kwargs)


def inputs(device, seed=0, soft=False, pattern="uneven", tile=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    class_weights = torch.rand(V, generator=g, dtype=torch.float64) + 0.1
    if soft:
        target = torch.softmax(3 * torch.randn(N, V, generator=g, dtype=torch.float64), -1)
    else:
        target = torch.randint(0, V, (N,), generator=g)
        if pattern == "uneven":  # tile k keeps k % 4 + 1 labels; the second tile is fully masked
            for start in range(0, N, tile):
                target[start + (start // tile) % 4 + 1 : start + tile] = -100
            target[tile : 2 * tile] = -100
        elif pattern == "all_ignored":
            target[:] = -100
    return [t.to(device) for t in (hidden, weight, bias, class_weights, target)]


def grads_of(out, leaves):
    return torch.autograd.grad(out.sum(), leaves)


KWARG_GRID = [
    dict(zip(("reduction", "label_smoothing", "class_weights", "bias", "soft"), values, strict=True))
    for values in itertools.product(
        ["mean", "sum", "none"], [0.0, 0.2], [False, True], [False, True], [False, True]
    )
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", KWARG_GRID, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_same_arguments_same_results_as_torch(device, case):
    hidden, weight, bias, class_weights, target = inputs(device, soft=case["soft"])
    kwargs = dict(reduction=case["reduction"], label_smoothing=case["label_smoothing"])
    if case["class_weights"]:
        kwargs["weight"] = class_weights
    if case["bias"]:
        kwargs["linear_bias"] = bias.requires_grad_()
    leaves = [hidden.requires_grad_(), weight.requires_grad_()] + ([bias] if case["bias"] else [])
    expected = torch_linear_cross_entropy(hidden, weight, target, **kwargs)
    got = tile_pass.linear_cross_entropy(hidden, weight, target, tile_tokens=4, **kwargs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert_close_to_oracle(got, expected, torch.float64, "loss")
    for name, g, e in zip(
        ("input", "linear_weight", "linear_bias"),
        grads_of(got, leaves),
        grads_of(expected, leaves),
        strict=False,
    ):
        assert_close_to_oracle(g, e, torch.float64, f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["uneven", "all_ignored"])
@pytest.mark.parametrize("ignore_index", [None, -100, 5])
def test_class_weights_with_masks_in_float32(device, pattern, ignore_index):
    """Token weighting with class weights: the mean divides by the summed class weights of
    the valid labels, across tiles with uneven counts and a fully masked tile; an all-ignored
    batch is NaN with zero gradients, as eager."""
    hidden, weight, _, class_weights, target = inputs(device, pattern=pattern)
    if ignore_index == 5:
        target = torch.where(target == -100, 5, torch.where(target == 5, 6, target))
    oracle = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    test = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    expected = F.cross_entropy(
        F.linear(*oracle),
        target,
        weight=class_weights,
        ignore_index=-100 if ignore_index is None else ignore_index,
    )
    got = tile_pass.linear_cross_entropy(
        *test, target, weight=class_weights.float(), ignore_index=ignore_index, tile_tokens=4
    )
    assert_close_to_oracle(got, expected, torch.float32, "loss")
    for g, e in zip(grads_of(got, test), grads_of(expected, oracle), strict=True):
        assert_close_to_oracle(g, e, torch.float32, "grad")
        if pattern == "all_ignored":
            assert not g.any()


def test_batched_probability_targets_and_none_shape():
    hidden = torch.randn(2, 5, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64)
    target = torch.softmax(torch.randn(2, 5, V, dtype=torch.float64), -1)
    got = tile_pass.linear_cross_entropy(hidden, weight, target, reduction="none", tile_tokens=3)
    expected = F.cross_entropy(F.linear(hidden, weight).view(-1, V), target.view(-1, V), reduction="none")
    assert got.shape == (2, 5)
    torch.testing.assert_close(got.view(-1), expected)


def test_argument_collisions_name_the_fix():
    hidden, weight, bias, class_weights, target = inputs("cpu")
    with pytest.raises(TypeError, match=r"weight= is the class weights.*linear_weight="):
        tile_pass.linear_cross_entropy(hidden, weight, target, weight=weight)
    with pytest.raises(TypeError, match="bias once"):
        tile_pass.linear_cross_entropy(hidden, weight, target, bias, linear_bias=bias)
    soft = inputs("cpu", soft=True)[-1]
    with pytest.raises(
        RuntimeError, match="ignore_index cannot be specified when target contains probabilities"
    ):
        tile_pass.linear_cross_entropy(hidden, weight, soft, ignore_index=-100)
    if HAS_TORCH_LCE:
        with pytest.raises(RuntimeError, match="ignore_index cannot be specified"):
            F.linear_cross_entropy(hidden, weight, soft, ignore_index=-100)  # the same as torch
    with pytest.raises(RuntimeError, match="for all 13 classes"):
        tile_pass.linear_cross_entropy(hidden, weight, target, weight=class_weights[:4])
    # positional bias (earlier callers) is linear_bias
    torch.testing.assert_close(
        tile_pass.linear_cross_entropy(hidden, weight, target, bias),
        torch_linear_cross_entropy(hidden, weight, target, linear_bias=bias),
    )


def test_traced_with_class_weights_under_fullgraph():
    hidden, weight, _, class_weights, target = inputs("cpu")

    def loss(h, w, y, cw):
        return tile_pass.linear_cross_entropy(h, w, y, weight=cw, tile_tokens=4)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(
        compiled(hidden, weight, target, class_weights),
        F.cross_entropy(F.linear(hidden, weight), target, weight=class_weights),
    )


# --------------------------------------------------------------------------- the pass


def head_class_weights(h, w, y, cw):
    return F.cross_entropy(F.linear(h, w), y, weight=cw, label_smoothing=0.1)


def head_nll_class_weights(h, w, y, cw):
    return F.nll_loss(F.log_softmax(F.linear(h, w), dim=-1), y, weight=cw, reduction="sum")


def head_probabilities(h, w, p):
    return F.cross_entropy(F.linear(h, w).view(-1, V), p.view(-1, V))


def head_probabilities_none(h, w, p):
    return F.cross_entropy(F.linear(h, w), p, reduction="none", label_smoothing=0.1) * 2.0


@pytest.mark.parametrize(
    "head",
    [head_class_weights, head_nll_class_weights, head_probabilities, head_probabilities_none],
    ids=lambda f: f.__name__,
)
def test_pass_matches_class_weights_and_probability_targets(head):
    hidden, weight, _, class_weights, target = inputs("cpu", soft="probabilities" in head.__name__)
    extra = () if "probabilities" in head.__name__ else (class_weights.float(),)
    oracle = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    test = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    target_test = target.float() if target.is_floating_point() else target
    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    got = torch.compile(head, backend=backend)(*test, target_test, *extra)
    expected = head(*oracle, target, *(e.double() for e in extra))
    (rewrite,) = backend.report().rewrites
    assert ("class weights" in rewrite.form) != ("probabilities" in head.__name__), rewrite.form
    assert_close_to_oracle(got, expected, torch.float32, "loss")
    for g, e in zip(grads_of(got, test), grads_of(expected, oracle), strict=True):
        assert_close_to_oracle(g, e, torch.float32, "grad")


# ------------------------------------------------- PyTorch's own OpInfo samples, gradients included


def _opinfo_samples(dtype):
    pytest.importorskip("expecttest")  # torch's testing internals import it
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.name == "nn.functional.linear_cross_entropy"]
    if not ops:
        pytest.skip("this torch has no OpInfo for linear_cross_entropy")
    return [s for op in ops for s in op.sample_inputs("cpu", dtype, requires_grad=True)]


def _fresh(sample):
    def leaf(t):
        return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    return [leaf(a) for a in (sample.input, *sample.args)], {k: leaf(v) for k, v in sample.kwargs.items()}


@pytest.mark.skipif(not HAS_TORCH_LCE, reason="this torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_pytorch_opinfo_samples_with_every_gradient(dtype):
    """Every OpInfo sample of torch's op (class indices and probabilities, class weights, a
    bias, each reduction, K-dimensional weights, torch's chunking options), through
    ``tile_pass.linear_cross_entropy``: the same loss and the same gradients of every input
    that requires grad, the class-probability target's included, or the same exception."""
    import warnings

    samples = _opinfo_samples(dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    differentiated_targets = 0
    for sample in samples:
        (args, kwargs), (ours_args, ours_kwargs) = _fresh(sample), _fresh(sample)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = F.linear_cross_entropy(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any eager error must be ours too
            with pytest.raises(type(error)):
                tile_pass.linear_cross_entropy(*ours_args, **ours_kwargs)
            continue
        ours = tile_pass.linear_cross_entropy(*ours_args, **ours_kwargs)
        torch.testing.assert_close(ours, expected, equal_nan=True, **tol)

        def differentiated(tensors):
            return [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]

        wanted, mine = (
            differentiated((*args, *kwargs.values())),
            differentiated((*ours_args, *ours_kwargs.values())),
        )
        upstream = torch.randn_like(expected)
        got = torch.autograd.grad(ours, mine, upstream, allow_unused=True)
        want = torch.autograd.grad(expected, wanted, upstream, allow_unused=True)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g, w, equal_nan=True, **tol)
        differentiated_targets += bool(args[2].requires_grad)
    assert len(samples) > 100 and differentiated_targets > 20  # the probability targets' gradients ran


# ------------------------------------------------- bad arguments: torch's op's errors, or eager's (issue 48)


class _NotOptions:
    """An ``options=`` that is not torch's ``LinearCrossEntropyOptions`` (no ``_adjust``)."""


#: arguments torch's op or eager refuses, or takes where a check might wrongly refuse them
BAD_ARGUMENTS = [
    dict(reduction="bogus"),
    dict(reduction=None),
    dict(label_smoothing=1.1),
    dict(label_smoothing=-0.1),
    dict(label_smoothing=float("nan")),
    dict(label_smoothing=2),
    dict(options="batch"),
    dict(options=_NotOptions()),
    dict(options=_NotOptions(), label_smoothing=0.1),
    dict(options=_NotOptions(), reduction="bogus"),
    dict(options=_NotOptions(), label_smoothing=1.1),
]


def _argument_id(kwargs) -> str:
    return ",".join(
        f"{k}={type(v).__name__ if isinstance(v, _NotOptions) else v!r}" for k, v in kwargs.items()
    )


def _outcome(call):
    """``("ok", value)`` or ``(exception type, message)``."""
    try:
        return "ok", call()
    except Exception as error:  # noqa: BLE001 - the outcome compared is the exception itself
        return type(error), str(error)


def _assert_same_outcome(expected, got):
    if expected[0] == "ok":
        assert got[0] == "ok", f"torch computes a loss; tile_pass raised {got}"
        torch.testing.assert_close(got[1], expected[1], equal_nan=True)
    else:
        assert got == expected, f"tile_pass raised {got}, torch {expected}"


def _bad_argument_inputs(soft):
    hidden, weight, bias, _, target = inputs("cpu", soft=soft)
    return hidden, weight, bias, target


@pytest.mark.skipif(not HAS_TORCH_LCE, reason="this torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("soft", [False, True], ids=["indices", "probabilities"])
@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS, ids=_argument_id)
def test_bad_arguments_raise_what_torchs_op_raises(kwargs, soft):
    """Where torch has ``F.linear_cross_entropy``: its exception type and message for a bad
    reduction, label smoothing or chunking ``options``; where it computes (a negative or NaN
    label smoothing, options it ignores), the same loss."""
    hidden, weight, bias, target = _bad_argument_inputs(soft)
    kwargs = dict(kwargs, linear_bias=bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "options ignored"
        expected = _outcome(lambda: F.linear_cross_entropy(hidden, weight, target, **kwargs))
        got = _outcome(
            lambda: tile_pass.linear_cross_entropy(hidden, weight, target, tile_tokens=4, **kwargs)
        )
    _assert_same_outcome(expected, got)


def test_label_smoothing_outside_the_unit_interval_as_torch():
    """The cases issue 48 names, pinned: above 1 is cross entropy's ``RuntimeError`` (torch's op
    passes it on); a negative one is taken, as torch takes it, with the unsmoothed loss and
    gradients."""
    hidden, weight, _, target = _bad_argument_inputs(False)
    with pytest.raises(RuntimeError, match=r"label_smoothing must be between 0.0 and 1.0. Got: 1.1"):
        tile_pass.linear_cross_entropy(hidden, weight, target, label_smoothing=1.1)
    leaves = [hidden.requires_grad_(), weight.requires_grad_()]
    got = tile_pass.linear_cross_entropy(hidden, weight, target, label_smoothing=-0.1, tile_tokens=4)
    expected = torch_linear_cross_entropy(hidden, weight, target, label_smoothing=-0.1)
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads_of(got, leaves), grads_of(expected, leaves), strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("soft", [False, True], ids=["indices", "probabilities"])
@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS, ids=_argument_id)
def test_bad_arguments_raise_what_eager_raises_without_torchs_op(kwargs, soft, monkeypatch):
    """Where torch has no ``F.linear_cross_entropy`` (hidden from tile_pass here): eager's
    ``F.cross_entropy(F.linear(...))`` errors; ``options`` configure nothing there and are ignored."""
    import tile_pass.functional

    monkeypatch.setattr(tile_pass.functional, "_torch_op", lambda: None)
    hidden, weight, bias, target = _bad_argument_inputs(soft)
    eager_kwargs = {k: v for k, v in kwargs.items() if k != "options"}

    def eager():
        return F.cross_entropy(F.linear(hidden, weight, bias), target, **eager_kwargs)

    got = _outcome(
        lambda: tile_pass.linear_cross_entropy(
            hidden, weight, target, linear_bias=bias, tile_tokens=4, **kwargs
        )
    )
    _assert_same_outcome(_outcome(eager), got)
