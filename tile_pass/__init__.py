"""tile_pass: a torch.compile pass that tiles the LM-head matmul + cross entropy.

``torch.compile(model, backend="tile_pass")`` finds ``logits = hidden @ W.T`` followed by
``F.cross_entropy`` in the graph and replaces it with a sequence-tiled, token-weighted
loss whose backward is derived, so the ``[tokens, vocab]`` logits never exist whole.
"""

from tile_pass import (
    _logging,  # noqa: F401  (registers TORCH_LOGS="tile_pass")
    _settings,  # noqa: F401  (reads TILE_PASS_* once; a bad value fails here)
)
from tile_pass._caches import clear_caches
from tile_pass._compile import compile
from tile_pass._options import TileOptions
from tile_pass.decorator import TiledLossNotApplied, tiled_loss
from tile_pass.dynamo_backend import Backend, backend, default_backend, explain, tile_pass_backend
from tile_pass.functional import linear_cross_entropy
from tile_pass.report import GraphReport, Report, Rewrite, Skip
from tile_pass.validation import ValidationError, ValidationResult, validate

__all__ = [
    "Backend",
    "GraphReport",
    "Report",
    "Rewrite",
    "Skip",
    "TileOptions",
    "TiledLossNotApplied",
    "ValidationError",
    "ValidationResult",
    "backend",
    "clear_caches",
    "compile",
    "default_backend",
    "explain",
    "linear_cross_entropy",
    "tile_pass_backend",
    "tiled_loss",
    "validate",
]
__version__ = "0.1.0"
