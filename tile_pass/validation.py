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
from collections.abc import Callable
from typing import Any

import torch

from tile_pass.dynamo_backend import Backend
from tile_pass.inspection._oracle import (
    ValidationError,
    ValidationResult,
    as_double,
    compare,
    finish,
    fresh,
    is_float,
)

__all__ = ["ValidationError", "ValidationResult", "validate"]


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
    backend = backend if backend is not None else Backend("aot_eager")
    is_module = isinstance(model_or_fn, torch.nn.Module)
    reference = copy.deepcopy(model_or_fn).double() if is_module else model_or_fn
    args64 = [as_double(a) for a in args]
    kwargs64 = {k: as_double(v) for k, v in kwargs.items()}
    args_test = [fresh(a) for a in args]
    kwargs_test = {k: fresh(v) for k, v in kwargs.items()}

    loss = _loss_of(torch.compile(model_or_fn, backend=backend)(*args_test, **kwargs_test))
    ref_loss = _loss_of(reference(*args64, **kwargs64))
    if is_module:
        named = [(n, p) for n, p in model_or_fn.named_parameters() if p.requires_grad]
        ref_named = dict(reference.named_parameters())
        targets, ref_targets = [p for _, p in named], [ref_named[n] for n, _ in named]
        names = [n for n, _ in named]
    else:
        positions = [i for i, a in enumerate(args_test) if is_float(a) and a.requires_grad]
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
    finish(result, raise_on_mismatch)
    return result
