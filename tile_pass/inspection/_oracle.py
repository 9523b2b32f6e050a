"""The float64 oracle: compare a rewritten computation with eager in float64, per value.

:func:`compare` measures one tensor against its reference; :func:`validating_call` wraps a
compiled graph so its first call is checked against Dynamo's original graph run in float64
(``tile_pass.backend(validate=True)``); :func:`tile_pass.validate` (in
:mod:`tile_pass.validation`) runs a whole model both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def as_double(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().double().requires_grad_(value.requires_grad)
    return value


def is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def fresh(value):
    """A floating tensor detached and cloned, requiring grad as it did; anything else as it is."""
    return value.detach().clone().requires_grad_(value.requires_grad) if is_float(value) else value


def finish(result: ValidationResult, raise_on_mismatch: bool) -> None:
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
            finish(result, raise_on_mismatch=True)
        return compiled(*args)

    return run


def _validate_graph(
    original: torch.fx.GraphModule, compiled: Callable, args: Sequence, num_outputs: int
) -> ValidationResult:
    needs_grad = [i for i, a in enumerate(args) if is_float(a) and a.requires_grad]
    test_args = [fresh(a) for a in args]  # requiring grad where ``needs_grad`` says
    ref_args = [as_double(a) if is_float(a) else a for a in test_args]
    oracle = FLOAT64_ORACLE
    try:
        ref_out = original(*ref_args)
    except RuntimeError as err:  # float64 does not run through this graph (fixed dtypes inside, memory)
        oracle = (
            f"same-dtype eager (float64 eager failed: {type(err).__name__}: {str(err).splitlines()[0][:200]})"
        )
        log.warning("tile_pass validation: %s; the check can only catch gross errors", oracle)
        ref_args = [fresh(a) for a in test_args]
        ref_out = original(*ref_args)
    with torch.enable_grad():
        out = compiled(*test_args)
    out, ref_out = list(out)[:num_outputs], list(ref_out)[:num_outputs]
    g = torch.Generator().manual_seed(0)
    rows, objective, ref_objective = [], 0, 0
    for i, (o, r) in enumerate(zip(out, ref_out, strict=True)):
        if not (is_float(o) and is_float(r)):
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
