"""The options of one tiling configuration, as one frozen value.

``tile_pass.backend(...)``, ``@tile_pass.tiled_loss(...)``, ``explain`` and the functional API
each build one :class:`TileOptions` and hand it, unchanged, to the rewrite
(:func:`tile_pass.rewrite.rewrite_graph`), which plans each region's tile from it and writes
the plan into the call it inserts. Checked once, here, where the user gave the values.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TileOptions:
    #: tokens per tile; ``None``: from the ``tile_bytes`` budget and the free memory (see _tiling)
    tile_tokens: int | None = None
    #: the byte budget of one tile's logits-sized buffers; ``None``: the default budget
    tile_bytes: int | None = None
    #: logits the graph also returns are never computed (a NaN placeholder is returned)
    drop_logits: bool = False
    #: the plan assumes tiles whose elementwise middle Inductor compiles (sizes follow its byte model)
    compile_tiles: bool = False
    #: whether the rewritten graph runs compiled tiles; ``None``: as planned. ``explain`` plans
    #: compiled tiles but runs them uncompiled, to stay quick
    run_compiled_tiles: bool | None = None
    #: an internal error of the pass raises instead of leaving the graph as Dynamo gave it
    strict: bool = False

    def __post_init__(self) -> None:
        if self.tile_tokens is not None and (isinstance(self.tile_tokens, bool) or self.tile_tokens < 1):
            raise ValueError(f"tile_tokens must be a positive integer, got {self.tile_tokens}")
        if self.tile_bytes is not None and (isinstance(self.tile_bytes, bool) or self.tile_bytes < 1):
            raise ValueError(f"tile_bytes must be a positive number of bytes, got {self.tile_bytes}")

    @property
    def runs_compiled_tiles(self) -> bool:
        return self.compile_tiles if self.run_compiled_tiles is None else self.run_compiled_tiles
