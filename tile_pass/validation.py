"""Check a rewrite against eager on the user's own model: loss and every gradient.

Two entry points:

* ``tile_pass.validate(model_or_fn, *args, **kwargs)``: runs the function compiled with
  tile_pass and an eager reference in float64 (a double copy of the module and of the
  floating inputs), compares the loss and the gradient of every parameter (or of every
  floating input that requires grad), and raises :class:`ValidationError` with a table of
  the worst errors if they disagree; otherwise returns the table.
* ``tile_pass.backend(validate=True)``: the same check per rewritten graph, on its first
  call with real inputs: the original graph run eagerly in float64 against the compiled,
  rewritten one, with a fixed random weighting of every output as the objective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tile_pass._logging import log

#: Maximum error, relative to the reference's largest magnitude, accepted per dtype.
TOLERANCES = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}


class ValidationError(AssertionError):
    """The rewritten computation disagrees with eager; the message holds the table."""


@dataclass
class Comparison:
    name: str
    dtype: str
    max_abs_error: float
    relative_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance


#: The reference every check prefers: the original computation in float64.
FLOAT64_ORACLE = "float64 eager"


@dataclass
class ValidationResult:
    rows: list[Comparison]
    #: what the rewritten run was compared with: :data:`FLOAT64_ORACLE`, or a same-dtype eager
    #: run (and why float64 could not be used), which can only show gross errors
    oracle: str = FLOAT64_ORACLE

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.rows] + [6])
        lines = [f"oracle: {self.oracle}"]
        lines.append(f"{'tensor':<{width}}  {'dtype':<9} {'max abs err':>12} {'rel err':>10} {'tol':>8}  ok")
        for r in sorted(self.rows, key=lambda r: r.relative_error / r.tolerance, reverse=True):
            lines.append(
                f"{r.name:<{width}}  {r.dtype:<9} {r.max_abs_error:>12.3e} {r.relative_error:>10.3e} "
                f"{r.tolerance:>8.0e}  {'yes' if r.ok else 'NO'}"
            )
        return "\n".join(lines)


def compare(name: str, actual: torch.Tensor | None, reference: torch.Tensor | None) -> Comparison:
    """One row: the error of ``actual`` against ``reference``, relative to its magnitude."""
    if actual is None or reference is None:
        missing = "actual" if actual is None else "reference"
        return Comparison(f"{name} ({missing} gradient missing)", "-", float("inf"), float("inf"), 0.0)
    tolerance = TOLERANCES.get(actual.dtype, 1e-4)
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    nan_mismatch = bool((a.isnan() != r.isnan()).any())
    diff = (a - r).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    inf_mismatch = bool(((a.isinf() | r.isinf()) & (a != r)).any())
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    scale = r.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max().item() if r.numel() else 0.0
    relative = max_abs / scale if scale > 0 else max_abs
    if nan_mismatch or inf_mismatch:
        relative = float("inf")
    return Comparison(name, str(actual.dtype).replace("torch.", ""), max_abs, relative, tolerance)


def _double(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().double().requires_grad_(value.requires_grad)
    return value


def _loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        "validate needs a loss: return a scalar tensor, an object with .loss, or a tuple whose first "
        f"element is the loss; got {type(output).__name__}"
    )


def validate(
    model_or_fn: Callable,
    *args: Any,
    backend: Callable | None = None,
    raise_on_mismatch: bool = True,
    **kwargs: Any,
) -> ValidationResult:
    """Run ``model_or_fn`` compiled with tile_pass and in float64 eager; compare loss and gradients.

    ``backend`` defaults to ``tile_pass.backend("aot_eager")`` (quick to compile; the rewrite
    is the same under inductor). The module's gradients are left as the compiled run made them.
    """
    from tile_pass.backend import Backend

    backend = backend if backend is not None else Backend("aot_eager")
    is_module = isinstance(model_or_fn, torch.nn.Module)
    reference = copy.deepcopy(model_or_fn).double() if is_module else model_or_fn
    args64 = [_double(a) for a in args]
    kwargs64 = {k: _double(v) for k, v in kwargs.items()}
    args_test = [a.detach().clone().requires_grad_(a.requires_grad) if _is_float(a) else a for a in args]
    kwargs_test = {
        k: v.detach().clone().requires_grad_(v.requires_grad) if _is_float(v) else v
        for k, v in kwargs.items()
    }

    loss = _loss_of(torch.compile(model_or_fn, backend=backend)(*args_test, **kwargs_test))
    ref_loss = _loss_of(reference(*args64, **kwargs64))
    if is_module:
        named = [(n, p) for n, p in model_or_fn.named_parameters() if p.requires_grad]
        ref_named = dict(reference.named_parameters())
        targets, ref_targets = [p for _, p in named], [ref_named[n] for n, _ in named]
        names = [n for n, _ in named]
    else:
        positions = [i for i, a in enumerate(args_test) if _is_float(a) and a.requires_grad]
        targets, ref_targets = [args_test[i] for i in positions], [args64[i] for i in positions]
        names = [f"input {i}" for i in positions]
    grads = torch.autograd.grad(loss, targets, allow_unused=True) if targets else []
    ref_grads = torch.autograd.grad(ref_loss, ref_targets, allow_unused=True) if targets else []
    rows = [compare("loss", loss, ref_loss)]
    rows += [compare(f"grad {n}", g, r) for n, g, r in zip(names, grads, ref_grads, strict=True)]
    if is_module:
        for p, g in zip(targets, grads, strict=True):
            p.grad = g
    result = ValidationResult(rows)
    _finish(result, raise_on_mismatch)
    return result


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _finish(result: ValidationResult, raise_on_mismatch: bool) -> None:
    if result.ok:
        log.info("tile_pass validation passed:\n%s", result)
        return
    message = f"tile_pass: the rewritten computation disagrees with eager ({result.oracle}):\n{result}"
    if raise_on_mismatch:
        raise ValidationError(message)
    log.warning("%s", message)


def validating_call(
    original: torch.fx.GraphModule, compiled: Callable, num_outputs: int, on_result: Callable | None = None
) -> Callable:
    """Wrap a compiled graph: its first call is checked against ``original`` run in float64;
    ``on_result`` receives the :class:`ValidationResult` (the backend keeps it in its report)."""
    state = {"checked": False}

    def run(*args):
        if not state["checked"]:
            state["checked"] = True
            result = _validate_graph(original, compiled, args, num_outputs)
            if on_result is not None:
                on_result(result)
            _finish(result, raise_on_mismatch=True)
        return compiled(*args)

    return run


def _validate_graph(
    original: torch.fx.GraphModule, compiled: Callable, args: Sequence, num_outputs: int
) -> ValidationResult:
    needs_grad = [i for i, a in enumerate(args) if _is_float(a) and a.requires_grad]
    test_args = [
        a.detach().clone().requires_grad_(i in needs_grad) if _is_float(a) else a for i, a in enumerate(args)
    ]
    ref_args = [_double(a) if _is_float(a) else a for a in test_args]
    oracle = FLOAT64_ORACLE
    try:
        ref_out = original(*ref_args)
    except RuntimeError as err:  # float64 does not run through this graph (fixed dtypes inside, memory)
        oracle = (
            f"same-dtype eager (float64 eager failed: {type(err).__name__}: {str(err).splitlines()[0][:200]})"
        )
        log.warning("tile_pass validation: %s; the check can only catch gross errors", oracle)
        ref_args = [
            a.detach().clone().requires_grad_(a.requires_grad) if _is_float(a) else a for a in test_args
        ]
        ref_out = original(*ref_args)
    with torch.enable_grad():
        out = compiled(*test_args)
    out, ref_out = list(out)[:num_outputs], list(ref_out)[:num_outputs]
    g = torch.Generator().manual_seed(0)
    rows, objective, ref_objective = [], 0, 0
    for i, (o, r) in enumerate(zip(out, ref_out, strict=True)):
        if not (_is_float(o) and _is_float(r)):
            continue
        rows.append(compare(f"output {i}", o, r))
        weight = torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.device)
        if o.requires_grad:
            objective = objective + (o * weight.to(o.dtype)).sum()
        if r.requires_grad:
            ref_objective = ref_objective + (r * weight.to(r.dtype)).sum()
    if needs_grad and isinstance(objective, torch.Tensor) and isinstance(ref_objective, torch.Tensor):
        grads = torch.autograd.grad(objective, [test_args[i] for i in needs_grad], allow_unused=True)
        ref_grads = torch.autograd.grad(ref_objective, [ref_args[i] for i in needs_grad], allow_unused=True)
        for i, gr, rg in zip(needs_grad, grads, ref_grads, strict=True):
            if gr is None and rg is None:
                continue
            rows.append(compare(f"grad of graph input {i}", gr, rg))
    return ValidationResult(rows, oracle)
