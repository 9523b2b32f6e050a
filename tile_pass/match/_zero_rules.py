"""Zero rules: where a step's value is zero whatever the logits (the tokens the tiles may skip).

``rule(step, of, token)`` answers from ``of(arg)`` (an operand's
:class:`~tile_pass.program._region.Zeros` or ``None``) and ``token(arg)`` (a per-token input?); it
is registered as an op's ``zeros`` fact and read by :func:`tile_pass.program._region.zero_where`.
"""

from __future__ import annotations

from tile_pass.program._region import ZeroAll, ZeroAny, ZeroIf, ZeroKind, Zeros


def _number(arg) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _either(*parts) -> Zeros | None:
    parts = tuple(p for p in parts if p is not None)
    return None if not parts else parts[0] if len(parts) == 1 else ZeroAny(parts)


def ignored_label(step, of, token):
    """A loss is zero, and its gradient too, at a token whose label is ``ignore_index``."""
    kwargs = dict(step.kwargs)
    target = step.args[1] if len(step.args) > 1 else kwargs.get("target")
    return ZeroIf(target.index, ZeroKind.EQUALS, kwargs.get("ignore_index", -100)) if token(target) else None


def product(step, of, token):
    """Zero where a factor is; a per-token factor where it is 0, but not for ``inf`` logits (0 * inf)."""
    factors = [ZeroIf(a.index, ZeroKind.ZERO, exact=False) if token(a) else of(a) for a in step.args]
    return _either(*factors) if len(factors) == 2 else None


def divide(step, of, token):
    """Zero where the dividend is, divided by a nonzero number."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] != 0 else None


def power(step, of, token):
    """Zero where the base is, to a positive power (``0 ** 0`` is 1)."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] > 0 else None


def sum_of(step, of, token):
    """Zero where both terms are."""
    a, b = (of(arg) for arg in step.args) if len(step.args) == 2 else (None, None)
    return None if a is None or b is None else ZeroAll((a, b))


def where(step, of, token):
    """``where(mask, x, 0)`` is zero where the mask is false or ``x`` is; ``where(mask, 0, y)``: true."""
    if len(step.args) != 3 or not token(step.args[0]):
        return None
    cond, x, y = step.args
    if _number(y) and y == 0:
        return _either(ZeroIf(cond.index, ZeroKind.FALSE), of(x))
    return _either(ZeroIf(cond.index, ZeroKind.TRUE), of(y)) if _number(x) and x == 0 else None


def masked_fill(step, of, token):
    """``masked_fill(mask, 0)`` is zero where the mask is true or the input is zero."""
    args = step.args
    if len(args) >= 3 and token(args[1]) and _number(args[2]) and args[2] == 0:
        return _either(ZeroIf(args[1].index, ZeroKind.TRUE), of(args[0]))
    return None


def first_factor(step, of, token):
    """``xlog1py(x, y) = x * log1p(y)`` is zero where ``x`` is; for a per-token ``x`` where it is
    0, but not for NaN logits (``xlog1py(0, nan)`` is NaN)."""
    if len(step.args) != 2:
        return None
    x = step.args[0]
    return ZeroIf(x.index, ZeroKind.ZERO, exact=False) if token(x) else of(x)


def keeps_zeros(step, of, token):
    """``f(0) == 0``: zero where the (first) operand is."""
    return of(step.args[0]) if step.args else None
