"""Bad input exactly as eager (issue 36): a property test over good and bad combinations.

Hypothesis draws a small valid case (N <= 9 tokens, H <= 8, V <= 12, class indices or class
probabilities, optional bias and class weights, a reduction, an ignore_index, label smoothing)
and applies one defect of a family (``FAMILIES``), maybe one more of any: dtypes of the hidden
states, head, bias, labels, class weights and probability targets; shape mismatches (H, label
count, the V of the bias, of the class weights and of the targets, a 2-D label column); labels
out of range or negative (not the ignore_index); empty batches; transposed or strided inputs;
other devices (CUDA only). Then:

* **compiled**: ``F.cross_entropy(F.linear(h, w, b).float(), y, ...)`` under
  ``torch.compile(backend=tile_pass.backend("aot_eager"))`` either raises what plain
  ``torch.compile(backend="aot_eager")`` raises (same exception type and message; Dynamo's
  wrappers such as ``TorchRuntimeError`` are compared as they are, and the error they wrap is
  named in their message) or returns eager's loss and gradients, and was then rewritten;
* **functional**: ``tile_pass.linear_cross_entropy`` either raises eager's exception type and
  message (eager: ``F.cross_entropy(F.linear(h, w, b), y, ...)`` with the logits upcast to
  float32 from half, as the function's ``upcast=True``; float64 is not downcast, as torch's
  ``F.linear_cross_entropy``) or returns eager's loss (same dtype and shape) and gradients.

``TILE_PASS_BAD_INPUT_EXAMPLES=200`` draws that many random examples per family (the default
draws the same few each run, to keep the file near a minute on 2 cores). ``docs/robustness.md``
summarises what this covers; ``python tests/test_bad_input.py`` prints its table.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tile_pass
from tile_pass.decorator import TiledLossNotApplied

EXAMPLES = int(os.environ.get("TILE_PASS_BAD_INPUT_EXAMPLES", "0")) or None
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HALF = (torch.bfloat16, torch.float16)
#: (hidden, head) dtypes that differ, the issue's first: Hypothesis tries a strategy's first values first
DTYPE_PAIRS = (
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
    + [(a, b) for a in FLOATS for b in FLOATS if a != b and b != torch.float32]
    + [(torch.float64, torch.float32)]
)
LABEL_DTYPES = [torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]
CUDA_ONLY = ("weight on cpu", "bias on cpu", "labels on cpu", "class weights on cpu")
#: each property is drawn per family: at least one defect of the family (and maybe one more of any)
FAMILIES = {
    "none": (),
    "linear dtypes": ("hidden and head dtypes", "bias dtype"),
    "loss dtypes": ("label dtype", "class weights dtype", "probability dtype"),
    "shapes": (
        "hidden H + 1",
        "labels N - 1",
        "labels N + 1",
        "labels a column [N, 1]",
        "bias V + 1",
        "class weights V - 1",
        "probabilities V + 1",
    ),  # fmt: skip
    "values": ("label == V", "label > V", "label negative", "empty batch"),
    "layouts": ("hidden transposed", "weight transposed", "hidden strided"),
    "devices": CUDA_ONLY,
}


def _settings(examples: int):
    return settings(
        max_examples=EXAMPLES or examples,
        deadline=None,
        derandomize=EXAMPLES is None,  # the suite's run: the same examples each time; asked for more: random
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# ------------------------------------------------------------------------------- the cases


def _defects(device: str) -> dict:
    """name -> what it changes in a valid case (a dict of sizes, dtypes and options)."""
    other = "cpu" if device != "cpu" else None

    def set_(**changes):
        return lambda case, draw: case.update(changes)

    defects = {
        "hidden and head dtypes": lambda case, draw: (
            case.update(zip(("dtype", "head_dtype"), draw(st.sampled_from(DTYPE_PAIRS)), strict=True))
            or case.update(bias=case["bias"] and case["dtype"])
        ),  # the bias follows the hidden states
        "bias dtype": lambda case, draw: case.update(
            bias=draw(st.sampled_from([d for d in FLOATS if d != case["dtype"]]))
        ),
        "label dtype": lambda case, draw: case.update(
            soft=None, label_dtype=draw(st.sampled_from(LABEL_DTYPES))
        ),
        "class weights dtype": lambda case, draw: case.update(
            class_weights=draw(st.sampled_from([torch.bfloat16, torch.float64, torch.int64]))
        ),
        "probability dtype": lambda case, draw: case.update(
            soft=draw(st.sampled_from([d for d in FLOATS if d != torch.float32]))
        ),
        "hidden H + 1": set_(hidden_extra=1),
        "labels N - 1": lambda case, draw: case.update(labels=max(case["n"] - 1, 0)),
        "labels N + 1": lambda case, draw: case.update(labels=case["n"] + 1),
        "labels a column [N, 1]": set_(soft=None, label_column=True),
        "bias V + 1": lambda case, draw: case.update(
            bias_len=case["v"] + 1, bias=case["bias"] or case["dtype"]
        ),
        "class weights V - 1": lambda case, draw: case.update(
            weights_len=case["v"] - 1, class_weights=case["class_weights"] or torch.float32
        ),
        "probabilities V + 1": lambda case, draw: case.update(
            soft=case["soft"] or torch.float32, probs_v=case["v"] + 1
        ),
        "label == V": set_(soft=None, bad_label="V"),
        "label > V": set_(soft=None, bad_label="V+5"),
        "label negative": set_(soft=None, bad_label="-3"),
        "empty batch": set_(n=0, labels=0),
        "hidden transposed": set_(layout="hidden transposed"),
        "weight transposed": set_(layout="weight transposed"),
        "hidden strided": set_(layout="hidden strided"),
    }
    if other is not None:
        defects.update({name: set_(elsewhere=name.split(" on ")[0]) for name in CUDA_ONLY})
        for name in ("label == V", "label > V", "label negative"):  # a device-side assert ends the process
            del defects[name]
    return defects


@st.composite
def cases(draw, device: str, family: str):
    dtype = draw(st.sampled_from([torch.float32, *FLOATS]))  # float32 twice as often
    n, v = draw(st.integers(1, 9)), draw(st.integers(2, 12))
    case = dict(
        device=device, n=n, h=draw(st.integers(1, 8)), v=v, dtype=dtype, head_dtype=dtype,
        bias=draw(st.sampled_from([None, dtype])), bias_len=v, labels=n, label_dtype=torch.int64,
        label_column=False, soft=draw(st.sampled_from([None, None, torch.float32])), probs_v=v,
        class_weights=draw(st.sampled_from([None, torch.float32])), weights_len=v, bad_label=None,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignore_index=draw(st.sampled_from([-100, -100, 0, v, -1])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1])), layout="contiguous", hidden_extra=0,
        elsewhere=None,
    )  # fmt: skip
    defects = _defects(device)
    names = []
    if family != "none":
        names.append(draw(st.sampled_from([n for n in FAMILIES[family] if n in defects])))
        names += draw(st.lists(st.sampled_from(sorted(set(defects) - {names[0]})), max_size=1))
    for name in names:
        defects[name](case, draw)
    case["defects"] = names
    return case


def build(case: dict, seed: int = 0):
    """``(leaves, args)``: the tensors gradients are taken of, and ``(h, w, y, b, class_weights)``."""
    g = torch.Generator().manual_seed(seed)
    n, h_size, v, device = case["n"], case["h"], case["v"], case["device"]
    hidden_size = h_size + case["hidden_extra"]
    layout = case["layout"]
    if layout == "hidden transposed":
        h_leaf = torch.randn(hidden_size, n, generator=g)
    elif layout == "hidden strided":
        h_leaf = torch.randn(2 * n, hidden_size, generator=g)
    else:
        h_leaf = torch.randn(n, hidden_size, generator=g)
    w_shape = (h_size, v) if layout == "weight transposed" else (v, h_size)
    w_leaf = torch.randn(*w_shape, generator=g) / h_size**0.5
    leaves = [h_leaf.to(device, case["dtype"]), w_leaf.to(device, case["head_dtype"])]
    if case["bias"] is not None:
        leaves.append(torch.randn(case["bias_len"], generator=g).to(device, case["bias"]))
    for t in leaves:
        t.requires_grad_(t.is_floating_point())
    views = {"hidden transposed": lambda t: t.t(), "hidden strided": lambda t: t[::2]}
    hidden = views.get(layout, lambda t: t)
    weight = leaves[1].t() if layout == "weight transposed" else leaves[1]
    if case["soft"] is not None:
        logits = 2 * torch.randn(case["labels"], case["probs_v"], generator=g)
        target = torch.softmax(logits, -1).to(case["soft"])
    else:
        labels = torch.randint(0, v, (case["labels"],), generator=g)
        if case["ignore_index"] != -100 and len(labels) > 1:
            labels[0] = case["ignore_index"]
        if case["bad_label"] is not None and len(labels):
            labels[-1] = {"V": v, "V+5": v + 5, "-3": -3}[case["bad_label"]]
        target = labels % 2 == 1 if case["label_dtype"] is torch.bool else labels.to(case["label_dtype"])
        if case["label_column"]:
            target = target[:, None]
    class_weights = None
    if case["class_weights"] is not None:
        class_weights = (torch.rand(case["weights_len"], generator=g) + 0.5).to(case["class_weights"])
    place = {name: ("cpu" if case["elsewhere"] == name else device) for name in ("labels", "class weights")}
    target = target.to(place["labels"])
    class_weights = None if class_weights is None else class_weights.to(place["class weights"])
    if case["elsewhere"] in ("weight", "bias"):
        index = 1 if case["elsewhere"] == "weight" else 2
        if index < len(leaves):
            leaves[index] = leaves[index].detach().cpu().requires_grad_()
            weight = leaves[1].t() if layout == "weight transposed" else leaves[1]
    bias = leaves[2] if len(leaves) > 2 else None
    return leaves, (hidden(leaves[0]), weight, target, bias, class_weights)


# ------------------------------------------------------------------------------ the runners


def textbook(h, w, y, b, class_weights, reduction, ignore_index, label_smoothing):
    """The pattern the pass rewrites, as a user writes it."""
    return F.cross_entropy(
        F.linear(h, w, b).float(), y, weight=class_weights, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )  # fmt: skip


IGNORE_WITH_PROBABILITIES = "ignore_index cannot be specified when target contains probabilities"


def reference(h, w, y, b, class_weights, reduction, ignore_index, label_smoothing):
    """Eager for ``linear_cross_entropy``: half logits upcast (its ``upcast=True``), float64 not
    downcast, and an explicit ignore_index with class probabilities refused as torch's
    ``F.linear_cross_entropy`` refuses it (``F.cross_entropy`` has no "unset" ignore_index)."""
    logits = F.linear(h, w, b)
    if y.is_floating_point() and y.shape == logits.shape and ignore_index != -100:  # ignore_index given
        raise RuntimeError(IGNORE_WITH_PROBABILITIES)  # torch's F.linear_cross_entropy's own check
    return F.cross_entropy(
        logits.float() if logits.dtype in HALF else logits, y, weight=class_weights, reduction=reduction,
        ignore_index=ignore_index, label_smoothing=label_smoothing,
    )  # fmt: skip


def functional(h, w, y, b, class_weights, reduction, ignore_index, label_smoothing):
    soft = y.is_floating_point() and y.shape == (*h.shape[:-1], w.shape[0])
    return tile_pass.linear_cross_entropy(
        h, w, y, linear_bias=b, weight=class_weights, reduction=reduction, tile_tokens=4,
        ignore_index=None if soft and ignore_index == -100 else ignore_index, label_smoothing=label_smoothing,
    )  # fmt: skip


def outcome(fn, leaves, args, options):
    """``("ok", loss, gradients)`` or ``("raises", exception)``: forward and backward both count."""
    try:
        loss = fn(*args, **options)
        wanted = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad(loss.float().sum(), wanted, allow_unused=True)
        return "ok", loss, grads
    except Exception as error:  # noqa: BLE001 (any exception is an outcome to compare)
        return "raises", error


def _text(error: BaseException) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x?", str(error))


def _tolerance(dtype):
    return {torch.float64: 1e-9, torch.float32: 2e-5}.get(dtype, 3e-2)


def assert_same_outcome(got, expected, what: str, computed_in=torch.float64, same_message: bool = True):
    if expected[0] == "raises":
        assert got[0] == "raises", f"{what}: returned a loss where eager raises {expected[1]!r}"
        assert isinstance(got[1], type(expected[1])), f"{what}: raised {got[1]!r}, eager {expected[1]!r}"
        if same_message:
            assert _text(got[1]) == _text(expected[1]), f"{what}: raised {got[1]!r}, eager {expected[1]!r}"
        return
    assert got[0] == "ok", f"{what}: raised {got[1]!r} where eager returns a loss"
    (_, loss, grads), (_, loss_e, grads_e) = got, expected
    assert loss.dtype == loss_e.dtype and loss.shape == loss_e.shape, (what, loss.dtype, loss_e.dtype)
    pairs = zip(("grad h", "grad w", "grad b"), grads, grads_e, strict=False)
    for name, a, b in [("loss", loss, loss_e), *pairs]:
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is None:
            continue
        tol = max(_tolerance(b.dtype), _tolerance(computed_in))
        scale = b.detach().double().abs().nan_to_num(0.0, 0.0, 0.0).max().item() if b.numel() else 0.0
        torch.testing.assert_close(
            a.detach().double().cpu(), b.detach().double().cpu(), rtol=tol, atol=tol * max(scale, 1.0),
            equal_nan=True, msg=lambda m, name=name: f"{what}: {name}: {m}",
        )  # fmt: skip


def _options(case):
    return {k: case[k] for k in ("reduction", "ignore_index", "label_smoothing")}


def _describe(case) -> str:
    keys = ("n", "h", "v", "dtype", "bias", "soft", "class_weights", *_options(case))
    return f"defects {case['defects']} on " + ", ".join(f"{k}={case[k]}" for k in keys)


# ------------------------------------------------------------------------------ the properties


def _family(device: str, family: str) -> None:
    if family == "devices" and device == "cpu":
        pytest.skip("another device needs CUDA")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", DEVICES)
@_settings(examples=16)
@given(data=st.data())
def test_linear_cross_entropy_raises_or_matches_as_eager(device, family, data):
    _family(device, family)
    case = data.draw(cases(device, family))
    leaves, args = build(case)
    options = _options(case)
    expected = outcome(reference, leaves, args, options)
    assert_same_outcome(outcome(functional, leaves, args, options), expected, _describe(case), case["dtype"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", DEVICES)
@_settings(examples=7)
@given(data=st.data())
def test_compiled_rewrite_raises_or_matches_as_plain_compile(device, family, data):
    _family(device, family)
    case = data.draw(cases(device, family))
    leaves, args = build(case)
    options, what = _options(case), _describe(case)
    computed_in = torch.float32 if case["dtype"] is torch.float64 else case["dtype"]  # the pattern's .float()
    eager = outcome(textbook, leaves, args, options)
    torch._dynamo.reset()
    plain = outcome(torch.compile(textbook, backend="aot_eager", dynamic=False), leaves, args, options)
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    rewritten = outcome(torch.compile(textbook, backend=backend, dynamic=False), leaves, args, options)
    assert_same_outcome(rewritten, plain, what, computed_in)
    if eager[0] == "raises":  # Dynamo may wrap eager's error; plain compile's wrapping is the reference
        assert rewritten[0] == "raises", what
    if rewritten[0] == "ok":
        assert_same_outcome(rewritten, eager, what, computed_in)
        assert len(backend.report().rewrites) == 1, f"{what}: not rewritten\n{backend.report()}"


# ------------------------------------------------------------------ the case, every path

N, H, V = 16, 8, 12


def _mixed(hidden_dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g).to(hidden_dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    return h, w, torch.randint(0, V, (N,), generator=g)


def _loss(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _error(fn, *args):
    with pytest.raises(Exception) as info:  # noqa: PT011 (compared below)
        fn(*args)
    return info.value


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("hidden_dtype", HALF)
def test_half_hidden_with_float32_head_raises_as_eager(hidden_dtype, inner):
    """Issue 36: bf16/fp16 hidden states and a float32 head outside autocast. The pass took the
    mixed dtypes with a half output (fake tensors do not check mm's dtypes) for autocast and
    returned a loss; eager and plain compilation raise."""
    args = _mixed(hidden_dtype)
    eager = _error(_loss, *args)
    assert type(eager) is RuntimeError and "same dtype" in str(eager)
    plain = _error(torch.compile(_loss, backend=inner), *args)
    torch._dynamo.reset()
    backend = tile_pass.backend(inner)
    got = _error(torch.compile(_loss, backend=backend), *args)
    assert type(got) is type(plain) and _text(got) == _text(plain)
    assert type(got) is RuntimeError and str(got) == str(eager)
    assert not backend.report().rewrites
    assert any("outside autocast" in s.reason for s in backend.report().skipped), str(backend.report())


@pytest.mark.parametrize("hidden_dtype", HALF)
def test_half_hidden_with_float32_head_decorator_and_functional(hidden_dtype):
    args = _mixed(hidden_dtype)
    eager = _error(_loss, *args)
    decorated = tile_pass.tiled_loss(inner="aot_eager")(_loss)
    got = _error(decorated, *args)
    assert not isinstance(got, TiledLossNotApplied) and type(got) is RuntimeError and str(got) == str(eager)
    got = _error(tile_pass.linear_cross_entropy, *args)
    assert type(got) is RuntimeError and str(got) == str(eager)


def _autocast_loss(h, w, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float(), y)


@pytest.mark.parametrize("where", ["in the graph", "around the call", "functional"])
def test_mixed_dtypes_under_autocast_are_still_tiled(where):
    """Under autocast the same mixed inputs are valid (autocast casts both to bfloat16): tiled,
    with eager autocast's loss and gradients."""
    h, w, y = _mixed(torch.bfloat16)
    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    if where == "in the graph":
        fn, expected_fn, context = torch.compile(_autocast_loss, backend=backend), _autocast_loss, None
    elif where == "around the call":
        fn, expected_fn, context = torch.compile(_loss, backend=backend), _loss, torch.bfloat16
    else:
        fn = lambda h, w, y: tile_pass.linear_cross_entropy(h, w, y, tile_tokens=4)  # noqa: E731
        expected_fn, context = _loss, torch.bfloat16
    with torch.autocast("cpu", dtype=context or torch.bfloat16, enabled=context is not None):
        expected = outcome(expected_fn, [h, w], (h, w, y), {})
        got = outcome(fn, [h, w], (h, w, y), {})
    assert expected[0] == "ok"
    assert_same_outcome(got, expected, where, computed_in=torch.bfloat16)
    if where != "functional":
        rewrites = backend.report().rewrites
        assert len(rewrites) == 1 and "autocast(bfloat16)" in rewrites[0].form, str(backend.report())


def test_one_token_with_class_weights():
    """Found by the property test: with one token, the class weights ``[V]`` broadcast to
    ``[1, V]`` looked like one row per token and were sliced per tile (the tile's
    ``cross_entropy`` then got ``[4, V]`` class weights and raised); a value with no token
    dimensions of its own is now shared by every row."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(1, H, generator=g), torch.randn(V, H, generator=g)
    y, class_weights = torch.randint(0, V, (1,), generator=g), torch.rand(V, generator=g) + 0.5

    def fn(h, w, y, class_weights):
        return F.cross_entropy(F.linear(h, w).float(), y, weight=class_weights)

    backend = tile_pass.backend("aot_eager", tile_tokens=4)
    got = torch.compile(fn, backend=backend)(h, w, y, class_weights)
    torch.testing.assert_close(got, fn(h, w, y, class_weights))
    assert len(backend.report().rewrites) == 1


# ------------------------------------------------------------------------- the docs' table


def _cell(result, rewrites=None) -> str:
    if result[0] == "ok":
        return "loss" + ("" if rewrites is None else (", rewritten" if rewrites else ", not rewritten"))
    error, short = result[1], lambda text: text if len(text) <= 80 else text[:77] + "..."
    found = re.search(r"got (\w+)\('([^']*)", _text(error))  # what Dynamo's fake-tensor run wraps
    if isinstance(error, torch._dynamo.exc.TorchRuntimeError) and found:
        return f"{type(error).__name__} of {found[1]}: {short(found[2])}"
    return f"{type(error).__name__}: {short(_text(error).strip().splitlines()[0])}"


def _choices(apply, base) -> list:
    """The values a defect draws from (``[None]`` for a fixed one)."""
    seen = []
    apply(dict(base), lambda strategy: seen.append(list(strategy.elements)) or seen[-1][0])
    return seen[0] if seen else [None]


def table() -> str:
    """One row per defect value on a fixed valid case (CPU, float32, with a bias): each column's
    outcome (the functional's eager, :func:`reference`, is the pattern's own on every row)."""
    base = dict(
        device="cpu", n=6, h=8, v=11, dtype=torch.float32, head_dtype=torch.float32, bias=torch.float32,
        bias_len=11, labels=6, label_dtype=torch.int64, label_column=False, soft=None, probs_v=11,
        class_weights=None, weights_len=11, bad_label=None, reduction="mean", ignore_index=-100,
        label_smoothing=0.0, layout="contiguous", hidden_extra=0, elsewhere=None, defects=[],
    )  # fmt: skip
    rows = [
        "| input | eager | plain `torch.compile` | tile_pass backend | `linear_cross_entropy` |",
        "|---|---|---|---|---|",
    ]
    for name, apply in [("none (the valid case)", lambda case, draw: None), *_defects("cpu").items()]:
        for value in _choices(apply, base):
            case = dict(base)
            apply(case, lambda strategy, value=value: value)
            label = f"{name} ({str(value).replace('torch.', '')})" if value is not None else name
            leaves, args = build(case)
            options = _options(case)
            torch._dynamo.reset()
            plain = outcome(
                torch.compile(textbook, backend="aot_eager", dynamic=False), leaves, args, options
            )
            torch._dynamo.reset()
            backend = tile_pass.backend("aot_eager", tile_tokens=4)
            compiled = outcome(torch.compile(textbook, backend=backend, dynamic=False), leaves, args, options)
            eager, direct = (_cell(outcome(f, leaves, args, options)) for f in (textbook, functional))
            assert (
                _cell(outcome(reference, leaves, args, options)) == eager
            )  # the functional's eager is the same
            cells = [eager, _cell(plain), _cell(compiled, len(backend.report().rewrites)), direct]
            rows.append(f"| {label} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table())


def _masked_mean(h, w, y):
    """A hand-written masked mean: over no labelled token it is 0/0, and eager's gradient is NaN
    at every token (zero times the NaN weight), unlike ``F.cross_entropy``'s (zero)."""
    logits = (h @ w.t()).float()
    mask = y != -100
    logps = logits.log_softmax(-1).gather(-1, torch.where(mask, y, 0).unsqueeze(-1)).squeeze(-1)
    return -(logps * mask).sum() / mask.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ignored", ["all", "some"])
def test_all_ignored_masked_mean_is_nan_as_eager(device, ignored):
    """Skipped tokens (a zero mask) run where their loss weight is not finite, so the gradient
    is eager's NaN, not zero; with some labels the skip stands and the result is finite."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g).to(device).requires_grad_()
    w = torch.randn(16, 8, generator=g).to(device).requires_grad_()
    y = torch.full((12,), -100, device=device)
    if ignored == "some":
        y[3] = 5
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=4, strict=True)
    results = []
    for fn in (_masked_mean, torch.compile(_masked_mean, backend=backend)):
        loss = fn(h, w, y)
        results.append((loss, *torch.autograd.grad(loss, [h, w])))
    assert len(backend.report().rewrites) == 1
    for got, eager in zip(results[1], results[0], strict=True):
        assert torch.equal(got.isnan(), eager.isnan())
        torch.testing.assert_close(got, eager, equal_nan=True)
    assert results[0][1].isnan().all() == (ignored == "all")


# ------------------------------------------------- what eager refuses and Inductor accepts (issue 47)


def _int32_labels():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    return h, w, torch.randint(0, V, (N,), generator=g, dtype=torch.int32)


def _eager_raises_warnings(caplog):
    return [r for r in caplog.records if r.name == "tile_pass" and "eager raises on this input" in r.message]


def test_int32_labels_under_inductor_warn_once_with_the_reason_and_the_line(caplog):
    """Eager raises on int32 class indices; Inductor, with the region left untouched, returns a
    loss as plain Inductor does. The step must not pass silently: one WARNING naming why the
    region was skipped and the user's line, however many steps run."""
    args = _int32_labels()
    eager = _error(_loss, *args)
    assert type(eager) is RuntimeError and "expected target dtype to be Long" in str(eager)
    backend = tile_pass.backend("inductor")
    step = torch.compile(_loss, backend=backend)
    with caplog.at_level(logging.WARNING, logger="tile_pass"):
        losses = [step(*args) for _ in range(2)]
    torch.testing.assert_close(losses[0], _loss(args[0], args[1], args[2].long()))  # Inductor's own loss
    (warning,) = _eager_raises_warnings(caplog)
    assert warning.levelno == logging.WARNING
    assert "torch.int32 target; eager expects int64" in warning.message, warning.message
    assert "test_bad_input.py:" in warning.message and "F.cross_entropy(F.linear(h, w).float(), y)" in (
        warning.message
    )
    (skip,) = backend.report().skipped
    assert skip.eager_raises and not backend.report().rewrites


def test_int32_labels_under_aot_eager_raise_eagers_error_without_a_warning(caplog):
    """With an inner compiler that runs the graph as eager does, the step raises eager's error
    itself: no warning is added to it."""
    args = _int32_labels()
    with caplog.at_level(logging.WARNING, logger="tile_pass"):
        got = _error(torch.compile(_loss, backend=tile_pass.backend("aot_eager")), *args)
    assert "expected target dtype to be Long" in str(got)
    assert not _eager_raises_warnings(caplog)


def test_explain_on_int32_labels_returns_a_report_saying_eager_raises():
    report = tile_pass.explain(_loss, *_int32_labels())
    assert not report.rewrites and report.skipped[0].eager_raises, str(report)
    assert report.eager_error == "RuntimeError: expected target dtype to be Long or Byte, but got Int"
    assert str(report).endswith(f"eager raises on this input: {report.eager_error}")
    assert report.to_dict()["eager_error"] == report.eager_error


def test_explain_still_raises_an_error_the_pass_did_not_skip_for():
    """Only eager's error on an input the pass refused for it is reported; any other error of the
    user's function is raised as before."""

    def broken(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y) + torch.ones(3) @ torch.ones(4)

    h, w, y = _int32_labels()
    with pytest.raises(RuntimeError, match="size"):
        tile_pass.explain(broken, h, w, y.long())


@pytest.mark.parametrize("smoothing", [-0.1, float("nan")], ids=["negative", "nan"])
def test_label_smoothing_eager_takes_as_none_is_tiled_and_exact(smoothing):
    """Eager smooths only above 0: a negative or NaN ``label_smoothing`` is a plain cross entropy
    there (it raises only above 1), and the rewrite tiles it as that, not as eager's error."""

    def loss(h, w, y):
        return F.cross_entropy(h @ w.T, y, label_smoothing=smoothing)

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 8, generator=g), torch.randn(20, 8, generator=g)
    y = torch.randint(0, 20, (12,), generator=g)
    backend = tile_pass.backend("aot_eager", tile_tokens=5, strict=True)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.compile(loss, backend=backend)(hc, wc, y)
    got.backward()
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    expected = F.cross_entropy(h64 @ w64.T, y)  # no smoothing
    expected.backward()
    torch.testing.assert_close(got.double(), expected.detach(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(hc.grad.double(), h64.grad, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(wc.grad.double(), w64.grad, rtol=2e-5, atol=2e-6)
