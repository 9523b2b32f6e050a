"""Looking through the wrappers that trainers put around a module's ``forward``."""

from __future__ import annotations

import types
from collections.abc import Iterator

import torch


def model_of(obj) -> torch.nn.Module:
    """The module behind ``obj``: the module itself, or a trainer's ``.model``."""
    if isinstance(obj, torch.nn.Module):
        return obj
    model = getattr(obj, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    raise TypeError(f"expected an nn.Module or a trainer with a .model, got {type(obj).__name__}")


def models_of(obj) -> list[torch.nn.Module]:
    """The modules a trainer runs: ``.model`` and, for TRL's trainers, ``.ref_model``."""
    found = [model_of(obj)]
    ref = getattr(obj, "ref_model", None)
    if isinstance(ref, torch.nn.Module) and ref is not found[0]:
        found.append(ref)
    return found


def forward_chain(module: torch.nn.Module, depth: int = 12) -> Iterator[object]:
    """Every callable reachable from the module's instance ``forward``: through bound methods
    (``__func__``), ``functools.wraps`` (``__wrapped__``), closures (TRL's ``original_forward``,
    accelerate's autocast and fp32 wrappers) and accelerate's ``_original_forward``.

    Yields nothing when the module runs its class's ``forward`` untouched.
    """
    start = [module.__dict__.get("forward"), module.__dict__.get("_original_forward")]
    todo = [(f, 0) for f in start if f is not None]
    seen: set[int] = set()
    while todo:
        f, level = todo.pop()
        if id(f) in seen or level > depth:
            continue
        seen.add(id(f))
        yield f
        nxt = [getattr(f, "__func__", None), getattr(f, "__wrapped__", None)]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                nxt.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        todo += [(g, level + 1) for g in nxt if callable(g) and not isinstance(g, (type, torch.nn.Module))]


def code_of(f) -> types.CodeType | None:
    return getattr(f, "__code__", None)
