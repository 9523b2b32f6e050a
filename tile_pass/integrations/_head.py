"""What every integration shares: how it takes its options, and the head and loss it compiles.

Every entry point takes ``inner`` and ``**backend_options``, resolved by :func:`backend_from`:
``inner`` compiles the rewritten graph (a name or a backend callable, as for
:func:`tile_pass.backend`; ``None``: the integration's default) or is a ready
:class:`tile_pass.Backend`; ``backend_options`` are :func:`tile_pass.backend`'s keywords
(``tiling=TileOptions(...)`` or its fields, ``dump_dir``, ``validate``, ``mode``, ...).

Where the model returns hidden states (a trainer's chunked loss or its fused head replaced),
the head and the loss become one function compiled by tile_pass: :class:`CompiledHead`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

import tile_pass
from tile_pass.dynamo_backend import Backend
from tile_pass.report import Report


def backend_from(inner: Any, backend_options: dict[str, Any], *, default: str = "inductor") -> Backend:
    """The backend an integration's ``inner`` and ``backend_options`` ask for (see the module
    docstring); a ready :class:`tile_pass.Backend` is used as it is, and takes no options."""
    if isinstance(inner, Backend):
        if backend_options:
            raise ValueError("pass either a tile_pass.Backend or backend options, not both")
        return inner
    return tile_pass.backend(default if inner is None else inner, **backend_options)


class CompiledHead:
    """The head and the loss of a model that returns hidden states, as one function
    ``head_and_loss`` compiled with ``backend``; ``name`` gives it a code object of its own
    (see :func:`own_code`). :meth:`report` says what was rewritten."""

    def __init__(self, head_and_loss: Callable, backend: Backend, name: str | None = None):
        self.backend = backend
        self._compiled = torch.compile(
            own_code(head_and_loss, name) if name else head_and_loss, backend=backend
        )

    def __call__(self, *args: Any) -> Any:
        return self._compiled(*args)

    def report(self) -> Report:
        return self.backend.report()


def own_code(func: Callable, name: str) -> Callable:
    """``func`` with a code object of its own: Dynamo keeps its compiled graphs (and counts its
    recompiles against ``torch._dynamo.config.recompile_limit``) per code object, so each compiled
    head gets its own budget instead of every one made from ``func`` sharing one."""
    renamed = {"co_name": name, **({"co_qualname": name} if hasattr(func.__code__, "co_qualname") else {})}
    code = func.__code__.replace(**renamed)
    own = types.FunctionType(code, func.__globals__, name, func.__defaults__, func.__closure__)
    own.__qualname__ = name
    return own
