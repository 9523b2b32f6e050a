"""``@tile_pass.tiled_loss``: compile exactly one loss or head function with the pass.

For people who do not compile the whole model: the decorated function (a plain function
or an ``nn.Module.forward``) is compiled with a tile_pass backend, and its first call fails
loudly with the pass's reasons if nothing in it could be tiled, instead of silently running
the untiled loss.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from tile_pass._options import TileOptions, tile_options
from tile_pass.dynamo_backend import Backend, CompilerFn

#: the decorator's own keywords beside the tiling's (named in the error for an unknown one)
_SETTINGS = ("fn", "inner", "fullgraph", "dynamic")


class TiledLossNotApplied(RuntimeError):
    """The decorated function holds no region the pass could tile; the message says why."""


def tiled_loss(
    fn: Callable | None = None,
    *,
    inner: str | CompilerFn = "inductor",
    tiling: TileOptions | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    **tile_fields: Any,
) -> Callable:
    """Decorate a loss/head function so it runs with the tiled loss.

    Use bare (``@tiled_loss``) or with options (``@tiled_loss(inner="aot_eager", tile_tokens=256)``):
    ``inner`` is the backend's, ``tiling=`` or :class:`~tile_pass.TileOptions`'s fields as keywords
    configure the tiles (checked here, at decoration), ``fullgraph`` and ``dynamic`` go to
    ``torch.compile``. The configured backend is available as ``fn.tile_pass_backend`` (its
    ``report()`` lists what was rewritten).
    """
    options = tile_options("tile_pass.tiled_loss", tiling, tile_fields, _SETTINGS)
    if fn is None:
        return functools.partial(
            tiled_loss, inner=inner, tiling=options, fullgraph=fullgraph, dynamic=dynamic
        )
    backend = Backend(inner, tiling=options)
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    checked = threading.Event()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        out = compiled(*args, **kwargs)
        if not checked.is_set():
            checked.set()
            report = backend.report()
            if not report.rewrites:
                reasons = "\n".join(f"  - {s.loss_source}: {s.reason}" for s in report.skipped)
                raise TiledLossNotApplied(
                    f"@tiled_loss on {fn.__qualname__}: no linear + cross_entropy region could be tiled.\n"
                    + (reasons or "  the function computes no F.linear/matmul followed by cross_entropy")
                    + "\nFix the reasons above, or remove @tiled_loss to run it untiled."
                )
        return out

    wrapper.tile_pass_backend = backend
    return wrapper
