"""Per-token values between the user's shapes and the tiles' flat rows.

The tiles see every per-token value flat, ``[N, *part]``; the user's graph has them as
``[B, T, *part]``, broadcast, or for a selection of the rows only. These functions are called
by the rewritten graph (inputs on the way in, outputs on the way out) and by a region's
reduction program (a token reduction folded into an op, finished after the tiles).
"""

from __future__ import annotations

import enum
import math

import torch

from tile_pass.program._row_selection import RowSelection, row_map


class TokenReduction(enum.Enum):
    """A token reduction an op folds in, finished after the tiles; the value is the report's name."""

    SUM = "sum"
    DIV_ELEMENTS = "div_elements"  # a mean over the tokens and the vocabulary
    DIV_TOKENS = "div_tokens"
    DIV_FIRST_DIM = "div_first_dim"  # kl_div's batchmean: the input's first dimension
    MEAN_VALID = "mean_valid"  # eager's denominator: the labelled tokens (class-weighted)


def after_tiles(flat: torch.Tensor, how: TokenReduction, hidden: torch.Tensor, flat_tokens: bool, *operands):
    """The token reduction an op folded in (``F.cross_entropy(reduction="mean")``, a full
    ``sum()``/``mean()``, ``kl_div(reduction="batchmean")``), finished on the tiles'
    per-token values exactly as eager defines it."""
    total = flat.sum()
    if how is TokenReduction.SUM:
        return total
    if how is TokenReduction.DIV_ELEMENTS:
        return total / (flat.shape[0] * operands[0])
    if how is TokenReduction.DIV_TOKENS:
        return total / flat.shape[0]
    if how is TokenReduction.DIV_FIRST_DIM:  # input.size(0), as the user's graph shaped the input
        return total / (flat.shape[0] if flat_tokens else hidden.shape[0])
    if how is TokenReduction.MEAN_VALID:
        target, class_weight, ignore_index = operands
        valid = target != ignore_index
        if class_weight is None:
            return total / valid.sum()
        safe = torch.where(valid, target, 0).clamp(0, class_weight.shape[0] - 1)
        return total / torch.where(valid, class_weight[safe], 0).sum()
    raise ValueError(f"unknown token reduction {how!r}")


def per_token(x: torch.Tensor, hidden: torch.Tensor, flat_tokens: bool, part_dims: int) -> torch.Tensor:
    """A per-token operand as the tiles take it: ``[N, *part]``, broadcast token dims expanded."""
    part = tuple(x.shape[x.dim() - part_dims :]) if part_dims else ()
    tokens = (math.prod(hidden.shape[:-1]),) if flat_tokens else tuple(hidden.shape[:-1])
    return x.expand(*tokens, *part).reshape(-1, *part)


def spread(
    x: torch.Tensor, hidden: torch.Tensor, flat_tokens: bool, part_dims: int, selection: RowSelection
) -> torch.Tensor:
    """A per-token operand of a selection of the token rows (``y[:B]`` beside ``logits[:B]``) as the
    tiles take it: ``[N, *part]`` over all rows, its own rows at the selection's and, elsewhere, a
    copy of its first row (finite wherever the data is; the outputs there are never read and get
    zero tangents, so they add exactly nothing to any gradient)."""
    part = tuple(x.shape[x.dim() - part_dims :]) if part_dims else ()
    rows = row_map(hidden, selection)
    picked = tuple(rows.shape)
    x = x.expand(*((math.prod(picked),) if flat_tokens else picked), *part).reshape(-1, *part)
    count = math.prod(hidden.shape[:-1])
    if x.numel() == 0:
        full = x.new_zeros((count, *part))
    else:
        full = x[:1].expand(count, *part).clone()
    full[rows.reshape(-1)] = x
    return full


def select(flat: torch.Tensor, hidden: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """The rows of a selection of a per-token output the tiles computed on all rows, flat."""
    return flat[row_map(hidden, selection).reshape(-1)]


def restore(flat: torch.Tensor, hidden: torch.Tensor, flat_tokens: bool) -> torch.Tensor:
    """A flat output of the tiles in the shape the user's graph gave it."""
    return flat if flat_tokens else flat.view(*hidden.shape[:-1], *flat.shape[1:])
