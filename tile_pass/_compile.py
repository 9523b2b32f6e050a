"""``tile_pass.compile(model)``: ``torch.compile`` with tile_pass, and the head kept whole across
transformers' once-only log calls (see :mod:`tile_pass._logging_calls`).

``torch.compile(model, backend=...)`` hands Dynamo its own wrapper of the backend, which drops the
``backend_ctx_ctor`` that Dynamo enters around every call of a compiled function; so a backend
cannot scope a Dynamo setting to the functions it compiles. This entry point hands Dynamo the
backend itself (``torch._dynamo.optimize``, what ``torch.compile`` calls), with that context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tile_pass import _logging_calls
from tile_pass.dynamo_backend import Backend, CompilerFn


def _scoped(backend: Backend) -> Callable:
    """``backend``, for Dynamo to enter :func:`~tile_pass._logging_calls.traced_past` around each call
    of what it compiles (a new function: the caller's Backend is not changed)."""

    def tile_pass_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        return backend(gm, example_inputs, **kwargs)

    tile_pass_compile.backend_ctx_ctor = _logging_calls.traced_past  # type: ignore[attr-defined]
    return tile_pass_compile


def compile(
    model: Callable,
    inner: str | CompilerFn | Backend = "inductor",
    *,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    **backend_options: Any,
) -> Callable:
    """``model`` compiled with tile_pass, as ``torch.compile(model, backend=tile_pass.backend(inner,
    **backend_options), fullgraph=fullgraph, dynamic=dynamic)`` returns it, except that while it
    runs Dynamo traces past transformers' once-per-process log calls (``warning_once``,
    ``info_once``) instead of ending the graph there: GPT-2, BERT, CTRL and the other models whose
    ``loss_type`` is unset keep their head and loss in one graph, unchanged. Those calls are
    dropped from the compiled code, and the one these models make (the ``loss_type`` fallback) is
    logged by transformers now, as the first eager forward would log it. Nothing is set for the
    process: other compiled functions break at those calls as before, and every other log call
    still breaks the graph and is printed.

    ``inner`` and ``backend_options`` are :func:`tile_pass.backend`'s (``tiling=``, the
    :class:`~tile_pass.TileOptions` fields, ``mode=``, ``options=``, ...), or ``inner`` is a ready
    :class:`tile_pass.Backend`. The result's ``tile_pass_backend`` is the backend (its ``report()``
    says what was rewritten).
    """
    if isinstance(inner, Backend):
        if backend_options:
            raise ValueError("pass either a tile_pass.Backend or backend options, not both")
        backend = inner
    else:
        backend = Backend(inner, **backend_options)
    _logging_calls.announce_loss_fallback(model)
    compiled = torch._dynamo.optimize(_scoped(backend), nopython=fullgraph, dynamic=dynamic)(model)
    compiled.tile_pass_backend = backend
    return compiled
