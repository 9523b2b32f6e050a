"""The options of one tiling configuration, as one frozen value.

Every entry point (``tile_pass.backend`` / :class:`~tile_pass.Backend`, ``@tile_pass.tiled_loss``,
``tile_pass.explain``, ``tile_pass.linear_cross_entropy``, the integrations, the command line)
takes one :class:`TileOptions` as ``tiling=`` or builds one from :class:`TileOptions`'s field names
given as keywords (:func:`tile_options`, which checks them), and hands it, unchanged but
:meth:`resolved <TileOptions.resolved>`, to the rewrite (:func:`tile_pass.rewrite.rewrite_graph`),
which plans each region's tile from it and writes the plan into the call it inserts. The fields
are documented here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tile_pass import _settings

#: the inner compilers under which tiles run uncompiled unless ``compile_tiles=True`` (debugging
#: compilers: the graph itself runs uncompiled there)
_UNCOMPILED_INNERS = ("eager", "aot_eager")


@dataclasses.dataclass(frozen=True)
class TileOptions:
    """How the pass tiles: ``tile_pass.backend("aot_eager", tiling=TileOptions(tile_tokens=256))``,
    or the same fields as keywords (``tile_pass.backend("aot_eager", tile_tokens=256)``).

    ``compile_tiles`` and ``strict`` default to ``None``, decided where the options are used
    (:meth:`resolved`); the rewrite receives them decided.
    """

    #: tokens per tile, fixed; ``None``: the largest tile the ``tile_bytes`` budget holds (see
    #: :mod:`tile_pass.plan._tiling`)
    tile_tokens: int | None = None
    #: the byte budget of one tile's logits-sized buffers; ``None``: the default budget, from the
    #: device's free memory
    tile_bytes: int | None = None
    #: logits the compiled function also returns are kept exact by default (model dtype, no upcast,
    #: no saved softmax, a gradient only if used); ``True`` opts out of them, as Liger and CCE do:
    #: they are never computed and a zero-byte NaN placeholder of their shape is returned
    drop_logits: bool = False
    #: compile each tile's elementwise work (softmax, loss, logits gradient) with Inductor, once per
    #: tile shape; the plan then sizes tiles by Inductor's byte model. ``None``: compiled unless the
    #: inner compiler is ``"eager"`` or ``"aot_eager"`` (the functional API: uncompiled)
    compile_tiles: bool | None = None
    #: whether the rewritten graph runs compiled tiles; ``None``: as planned (``compile_tiles``).
    #: ``explain`` plans compiled tiles but runs them uncompiled, to stay quick
    run_compiled_tiles: bool | None = None
    #: an internal error of the pass while matching, planning or rewriting a region raises, instead
    #: of leaving the graph as Dynamo gave it (a WARNING and an "internal error: ..." skip; a rewritten
    #: graph the inner compiler rejects is then compiled as Dynamo gave it). ``None``: the
    #: ``TILE_PASS_STRICT`` environment variable
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.tile_tokens is not None and (isinstance(self.tile_tokens, bool) or self.tile_tokens < 1):
            raise ValueError(f"tile_tokens must be a positive integer, got {self.tile_tokens}")
        if self.tile_bytes is not None and (isinstance(self.tile_bytes, bool) or self.tile_bytes < 1):
            raise ValueError(f"tile_bytes must be a positive number of bytes, got {self.tile_bytes}")

    def resolved(self, inner: str | Callable) -> TileOptions:
        """These options with their defaults decided for the inner compiler ``inner`` (the one place
        they are): tiles compiled unless ``inner`` is a debugging compiler, strict as the environment."""
        compile_tiles = inner not in _UNCOMPILED_INNERS if self.compile_tiles is None else self.compile_tiles
        strict = _settings.current().strict if self.strict is None else bool(self.strict)
        if (compile_tiles, strict) == (self.compile_tiles, self.strict):
            return self
        return _replaced(self, {"compile_tiles": bool(compile_tiles), "strict": strict})

    @property
    def runs_compiled_tiles(self) -> bool:
        return bool(self.compile_tiles if self.run_compiled_tiles is None else self.run_compiled_tiles)


#: the field names, in order (:func:`tile_options` and the functional API's cache key read them)
FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(TileOptions))


def _replaced(options: TileOptions, changes: Mapping[str, Any]) -> TileOptions:
    # not dataclasses.replace: this also runs while Dynamo traces the functional API
    values = {name: changes[name] if name in changes else getattr(options, name) for name in FIELDS}
    return TileOptions(**values)


def tile_options(
    entry: str, tiling: TileOptions | None, fields: Mapping[str, Any], settings: Sequence[str] = ()
) -> TileOptions:
    """The one :class:`TileOptions` of the entry point ``entry``: ``tiling`` (default: all defaults)
    with ``fields``, the keywords its caller gave by :class:`TileOptions`'s field names, in their
    place. Any other keyword is a ``TypeError`` naming the accepted ones (``settings``: the entry
    point's own) and the closest match."""
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        accepted = [*FIELDS, "tiling", *settings]
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"{entry}() got an unexpected keyword argument {unknown[0]!r}{hint}. It takes the fields of "
            f"tile_pass.TileOptions as keywords ({', '.join(FIELDS)}) or one TileOptions as tiling="
            + (f", and its own settings ({', '.join(settings)})" if settings else "")
            + "."
        )
    if tiling is not None and not isinstance(tiling, TileOptions):
        raise TypeError(
            f"{entry}(): tiling= takes a tile_pass.TileOptions, got {type(tiling).__name__}; pass "
            "TileOptions(...) or its fields as keywords"
        )
    base = TileOptions() if tiling is None else tiling
    return _replaced(base, fields) if fields else base
