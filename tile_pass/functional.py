"""The functional API: ``tile_pass.linear_cross_entropy``, torch's signature, tiled.

It checks its arguments as torch does (same errors, same messages where torch has them),
then runs the one region path: the textbook loss for its options, traced and rewritten by the
backend's own pass (:mod:`tile_pass._textbook`), so the tiles, their derived gradient, the
planner and every post-trace pass are the compiled path's own. A vocabulary-sharded
(``DTensor``) head is the same textbook region on this rank's rows
(:func:`tile_pass._distributed.local_head`).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F

from tile_pass import _textbook
from tile_pass._options import TileOptions, tile_options
from tile_pass.match._fx import autocast_dtype

_REDUCTIONS = ("mean", "sum", "none")
_HALF = (torch.float16, torch.bfloat16)


class _ClassWeightsError(TypeError, RuntimeError):
    """A 2-D ``weight=`` (the LM head under its old name): eager's ``RuntimeError`` (and the
    ``TypeError`` tile_pass raised before), naming the fix."""


def _class_weights_hint(weight: torch.Tensor) -> str:
    return (
        f"weight= is the class weights, a 1-D [V] tensor, as in torch's F.linear_cross_entropy and "
        f"F.cross_entropy; got shape {tuple(weight.shape)}. Pass the LM-head matrix [V, H] as the second "
        "positional argument (linear_weight=)."
    )


#: torch's ``F.linear_cross_entropy`` own check (``F.cross_entropy`` has no "unset" ignore_index)
_IGNORE_WITH_PROBABILITIES = "ignore_index cannot be specified when target contains probabilities"


# ------------------------------------------------------------------------- public API


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    upcast: bool = True,
    logit_scale: float | None = None,
    softcap: float | None = None,
    options: object | None = None,
    tiling: TileOptions | None = None,
    **tile_fields: Any,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias).float(), target, ...)``, tiled.

    A drop-in for torch's ``F.linear_cross_entropy``: the same arguments by the same names
    and meanings (``weight`` is the class weights, ``linear_bias`` the projection's bias,
    ``ignore_index=None`` means -100 for class indices), and the same results. ``input`` is
    ``[..., H]`` (torch's takes 1-D or 2-D) and ``target`` holds one class index per token
    (``[...]``) or class probabilities (``[..., V]``, floating). The ``[N, V]`` logits never
    exist: they are made one tile at a time, in forward and backward. The tiles are configured by
    ``tiling=`` or :class:`~tile_pass.TileOptions`'s fields as keywords (``tile_tokens=256``,
    ``tile_bytes=...``, ``compile_tiles=True``: Inductor compiles each tile's elementwise work, a
    one-off compile per tile shape; by default the tiles here run uncompiled).

    ``upcast=False`` computes the loss in the logits' own dtype, like ``F.cross_entropy`` on
    half-precision logits; float64 is never downcast. ``logit_scale`` multiplies the logits
    and ``softcap`` caps them (``softcap * tanh(logits / softcap)``, Gemma 2) before the
    upcast, inside each tile. With ``reduction="none"`` the result has the target's token
    shape (``()`` for one unbatched token). ``bias`` (positional) is the same as ``linear_bias``,
    kept for earlier callers. A ``DTensor`` ``linear_weight`` sharded over the vocabulary
    (``Shard(0)`` on a 1-D tensor-parallel mesh) runs the same region on this rank's rows (no
    bias, class weights or probability targets yet).

    ``options`` (torch's ``LinearCrossEntropyOptions``, which configures torch's own chunking)
    is accepted and has no effect: the tiles replace torch's chunks.

    Bad arguments raise what torch's ``F.linear_cross_entropy`` raises (its exception type and
    message) where this torch has the op, else what ``F.cross_entropy(F.linear(...))`` raises: the
    drop-in must fail where torch's op fails and nowhere else (a negative or NaN
    ``label_smoothing`` is eager's: no smoothing). A ``linear_weight`` of more
    than two dimensions is torch's K-dimensional loss (logits ``[N, C, d1, ...]``, no vocabulary
    to tile): it is computed as torch computes it, untiled.

    Works in eager code and inside ``torch.compile`` (no graph break, no host sync).
    """
    # the functional API's tiles run as eager code runs them: uncompiled unless compile_tiles=True
    tiling = tile_options("tile_pass.linear_cross_entropy", tiling, tile_fields, _SETTINGS).resolved("eager")
    if linear_weight.dim() > 2 and not _is_dtensor(linear_weight):
        return _k_dimensional(input, linear_weight, target, linear_bias if bias is None else bias, weight,
                              reduction, ignore_index, label_smoothing)  # fmt: skip
    hidden = input
    if bias is not None and linear_bias is not None:
        raise TypeError("pass the projection's bias once: as linear_bias= (torch's name) or positionally")
    bias = linear_bias if linear_bias is not None else bias
    head_shape, vocab_shard = linear_weight.shape, None  # a DTensor's shape is the whole head's
    if _is_dtensor(linear_weight):  # this rank's rows of a vocabulary-sharded head
        from tile_pass._distributed import local_head

        hidden, linear_weight, target, vocab_shard = local_head(hidden, linear_weight, target, bias, weight)
    else:  # eager's own checks, in eager's order, with its exception and message (before any tile)
        checked = hidden, linear_weight, bias, target, weight, reduction, ignore_index, label_smoothing
        _raise_as_eager_would(checked, upcast, options)
    vocab_size, hidden_size = _check_head(hidden, head_shape, bias, weight, reduction, label_smoothing)
    soft_targets, ignore_index = _check_target(target, hidden, vocab_size, ignore_index)
    target_shape = target.shape[:-1] if soft_targets else target.shape
    # [..., H] -> [N, H]; unlike reshape(-1, H) also for H == 0
    hidden = hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)
    target = target.reshape(-1, vocab_size) if soft_targets else target.reshape(-1)
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"Expected input batch_size ({hidden.shape[0]}) to match target batch_size ({target.shape[0]})."
        )
    hidden, linear_weight, bias = _as_autocast_casts(hidden, linear_weight, bias)
    upcast = bool(upcast) and hidden.dtype in _HALF
    loss_dtype = torch.float32 if upcast else hidden.dtype
    weight, target = _as_the_tiles_take(weight, target, loss_dtype, vocab_size, ignore_index, reduction)
    target_grad = soft_targets and target.requires_grad and torch.is_grad_enabled()
    # Python constants only (Dynamo hands them to an assume_constant_result function): under
    # dynamic=True the head's sizes and the options are specialised (a guard each; the token
    # count stays symbolic)
    options = _textbook.Options(
        vocab_size=operator.index(vocab_size), hidden_size=operator.index(hidden_size), dtype=hidden.dtype,
        device=str(hidden.device),
        has_bias=bias is not None, class_weights=weight is not None, soft_targets=soft_targets,
        upcast=upcast, logit_scale=_constant_float(logit_scale), softcap=_constant_float(softcap),
        target_dtype=target.dtype if soft_targets and target.dtype != loss_dtype else None,
        target_grad=target_grad,
        ignore_index=operator.index(ignore_index), label_smoothing=_smoothing(label_smoothing),
        reduction=reduction, tiling=_textbook.constant_tiling(tiling), vocab_shard=vocab_shard,
    )  # fmt: skip
    loss = _textbook.run(options, hidden, linear_weight, bias, target, weight)
    return loss.view(target_shape) if reduction == "none" else loss


def _raise_as_eager_would(checked: tuple, upcast: bool, options) -> None:
    """Raise what eager (or torch's op, for its options) raises for these arguments, if anything."""
    hidden, linear_weight, bias, target, weight, reduction, ignore_index, label_smoothing = checked
    if _departs(*checked, upcast):
        try:
            _raise_as_eager(*checked, upcast)
        except RuntimeError as error:
            if weight is None or weight.shape != linear_weight.shape or "weight tensor" not in str(error):
                raise
            raise _ClassWeightsError(f"{error}. {_class_weights_hint(weight)}") from error
    _raise_as_torch_for_options(*checked, options)


def _as_autocast_casts(hidden, linear_weight, bias):
    """The head's operands as ``F.linear`` gets them: autocast's dtype, else one shared dtype."""
    dtype = autocast_dtype(hidden.device.type)
    if dtype is not None:  # autocast's rule for F.linear
        hidden, linear_weight = hidden.to(dtype), linear_weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if not (hidden.dtype == linear_weight.dtype and (bias is None or bias.dtype == hidden.dtype)):
        raise RuntimeError(
            "input, linear_weight and linear_bias must share one dtype, as F.linear requires; got "
            f"{hidden.dtype}, {linear_weight.dtype}, {None if bias is None else bias.dtype}"
        )
    return hidden, linear_weight, bias


def _as_the_tiles_take(weight, target, loss_dtype, vocab_size, ignore_index, reduction):
    """Class weights and labels in the forms the tiles take, where eager accepts others."""
    if weight is not None and weight.dtype != loss_dtype:  # eager accepted it: autocast's cast
        weight = weight.to(loss_dtype)
    if target.dtype == torch.uint8:  # eager accepts Byte class indices; the tile's gather does not
        _check_byte_labels(target, vocab_size, ignore_index, reduction)
        target = target.long()
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        # eager's cross entropy (and torch's linear_cross_entropy) refuse to differentiate class
        # weights: raise exactly that, from eager itself, on one stand-in row
        row = torch.zeros((1, weight.shape[0]), dtype=weight.dtype, device=weight.device)
        F.cross_entropy(row, torch.zeros((1,), dtype=torch.long, device=weight.device), weight=weight)
    return weight, target


def _check_head(hidden, head_shape, bias, weight, reduction, label_smoothing) -> tuple[int, int]:
    """What eager accepts and the tiles do not, or a sharded head's input: raised before any tile.
    Returns ``(V, H)``."""
    if weight is not None and weight.dim() != 1:
        raise _ClassWeightsError(_class_weights_hint(weight))
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if label_smoothing > 1.0:  # eager's check (a negative or NaN one is no smoothing: _smoothing)
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    if len(head_shape) != 2:
        raise ValueError(f"tile_pass: linear_weight must be 2-D [V, H], got shape {tuple(head_shape)}")
    vocab_size, hidden_size = head_shape
    if hidden.dim() < 1 or hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"input's last dimension must equal linear_weight.shape[1] = {hidden_size}, "
            f"got input of shape {tuple(hidden.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (vocab_size,):  # as torch's F.linear_cross_entropy
        raise RuntimeError(f"expected linear_bias shape ({vocab_size},), got {tuple(bias.shape)}")
    if weight is not None and tuple(weight.shape) != (vocab_size,):
        raise RuntimeError(
            f"weight tensor should be defined either for all {vocab_size} classes or no classes"
        )
    return vocab_size, hidden_size


def _check_target(target, hidden, vocab_size: int, ignore_index) -> tuple[bool, int]:
    """Class indices (one per token) or class probabilities (``[..., V]``) as eager takes them;
    returns whether they are probabilities, and the ignore index in force."""
    soft_targets = _soft(target, hidden, vocab_size)
    if soft_targets and ignore_index is not None:
        raise RuntimeError(_IGNORE_WITH_PROBABILITIES)
    ignore_index = -100 if ignore_index is None else ignore_index
    if not soft_targets:
        if not _is_int(ignore_index):
            raise TypeError(f"ignore_index must be int, not {type(ignore_index).__name__}")
        if target.dtype not in (torch.long, torch.uint8):
            raise RuntimeError(f"expected target dtype to be Long or Byte, but got {target.dtype}")
        if target.dim() > 1 and tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(
                f"target must have shape input.shape[:-1] = {tuple(hidden.shape[:-1])} (one class index per "
                f"token) or be 1-D, got {tuple(target.shape)}"
            )
    return soft_targets, ignore_index


#: linear_cross_entropy's own keywords beside the tiling's (named in the error for an unknown one)
_SETTINGS = tuple(inspect.signature(linear_cross_entropy).parameters)[:-2]


def _torch_op():
    """torch's own ``F.linear_cross_entropy`` (torch 2.13 and later), or ``None``: the drop-in
    raises its errors where it exists, eager's ``F.cross_entropy(F.linear(...))``'s where not."""
    return getattr(F, "linear_cross_entropy", None)


def _raise_as_torch_for_options(
    hidden, linear_weight, bias, target, weight, reduction, ignore_index, label_smoothing, options
) -> None:
    """torch's error for ``options=`` that are not its ``LinearCrossEntropyOptions`` (its chunked
    path calls their ``_adjust``), raised by torch's op itself on one stand-in token; valid options,
    or a torch without the op, raise nothing (the tiles replace torch's chunks)."""
    op, options_type = _torch_op(), getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or op is None or (options_type is not None and isinstance(options, options_type)):
        return
    vocab, features = linear_weight.shape[0], hidden.shape[-1]
    soft = _soft(target, hidden, vocab)
    stand_in = torch.zeros((1, vocab) if soft else (1,), dtype=target.dtype, device=target.device)
    with torch.no_grad():  # (where torch's op warns that it ignores them, this warns as it does)
        op(
            hidden.new_zeros((1, features)), linear_weight, stand_in, linear_bias=bias, weight=weight,
            reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing, options=options,
        )  # fmt: skip


def _k_dimensional(input, linear_weight, target, bias, weight, reduction, ignore_index, label_smoothing):
    """torch's K-dimensional linear cross entropy, as torch defines it (not an LM head: untiled)."""
    if _torch_op() is not None:
        return _torch_op()(
            input, linear_weight, target, linear_bias=bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing,
        )  # fmt: skip
    classes, features = linear_weight.shape[0], linear_weight.shape[1:-1]
    flat_bias = None if bias is None else bias.reshape(-1)
    logits = F.linear(input, linear_weight.reshape(-1, linear_weight.shape[-1]), flat_bias)
    logits = logits.reshape(*input.shape[:-1], classes, *features)
    return F.cross_entropy(
        logits, target, weight=weight, reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index, label_smoothing=label_smoothing,
    )  # fmt: skip


def _soft(target: torch.Tensor, hidden: torch.Tensor, vocab_size) -> bool:
    """Whether ``target`` holds class probabilities: floating, of the logits' shape (as torch decides)."""
    return target.is_floating_point() and tuple(target.shape) == (*hidden.shape[:-1], vocab_size)


def _linear_fits(hidden, linear_weight, bias) -> bool:
    """Whether ``F.linear(hidden, linear_weight, bias)`` takes these as they are (a 2-D weight)."""
    if hidden.dim() < 1 or linear_weight.dim() != 2 or hidden.shape[-1] != linear_weight.shape[1]:
        return False
    if bias is not None and tuple(bias.shape) != (linear_weight.shape[0],):
        return False
    if any(t is not None and t.device != hidden.device for t in (linear_weight, bias)):
        return False
    return autocast_dtype(hidden.device.type) is not None or all(
        t is None or t.dtype == hidden.dtype for t in (linear_weight, bias)
    )


def _loss_dtype(hidden: torch.Tensor, upcast) -> torch.dtype:
    """The logits' dtype the loss sees: autocast's or the input's, float32 for half where ``upcast``."""
    dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    return torch.float32 if upcast and dtype in _HALF else dtype


def _departs(
    hidden, linear_weight, bias, target, weight, reduction, ignore_index, label_smoothing, upcast
) -> bool:
    """Whether the arguments depart from what the tiles take as they are (Python checks of
    shapes, dtypes, devices and options only): then :func:`_raise_as_eager` runs eager's own."""
    if not _linear_fits(hidden, linear_weight, bias):
        return True
    vocab = linear_weight.shape[0]
    if any(t is not None and t.device != hidden.device for t in (target, weight)):
        return True
    if reduction not in _REDUCTIONS or not _is_int(ignore_index if ignore_index is not None else 0):
        return True
    number = isinstance(label_smoothing, (int, float, torch.SymInt, torch.SymFloat))
    if not number or not 0 <= label_smoothing <= 1:
        return True
    if _soft(target, hidden, vocab):
        if ignore_index is not None:
            return True
    elif target.dtype not in (torch.long, torch.uint8) or tuple(target.shape) != tuple(hidden.shape[:-1]):
        return True
    if weight is None:
        return False
    return tuple(weight.shape) != (vocab,) or weight.dtype != _loss_dtype(hidden, upcast)


def _raise_as_eager(
    hidden, linear_weight, bias, target, weight, reduction, ignore_index, label_smoothing, upcast
) -> None:
    """Raises what eager raises on these arguments, if it does: ``F.cross_entropy(F.linear(input,
    linear_weight, linear_bias).float(), target, ...)`` (``.float()`` on half logits where
    ``upcast``), with torch's ``F.linear_cross_entropy``'s own ignore_index check; its exception
    type and message, in its order, before any tile runs.

    ``F.linear`` runs on the arguments themselves only where they do not fit together (eager
    raises before computing; a 1-D weight's ``[N]`` "logits" are cheap), and the loss on a
    zero-stride stand-in for the logits, of their device and dtype, under the caller's autocast:
    with the batch's rows only where a shape depends on them (eager's own path, which also
    computes the logits, needs more memory than that), else with one row."""
    with torch.no_grad():
        if not _linear_fits(hidden, linear_weight, bias):
            logits = F.linear(hidden, linear_weight, bias)  # eager's error, or odd "logits" (a 1-D weight's)
            logits = logits.float() if upcast and logits.dtype in _HALF else logits
        else:
            vocab = linear_weight.shape[0]
            shape = (*hidden.shape[:-1], vocab)
            soft = _soft(target, hidden, vocab)
            if soft and ignore_index is not None:
                raise RuntimeError(_IGNORE_WITH_PROBABILITIES)
            rows_fit = soft or tuple(target.shape) == shape[:-1]
            if hidden.dim() > 2:  # tile_pass's [..., H]: eager's loss of the flat tokens
                if not rows_fit:
                    return  # the function's own shape error
                target = target.reshape(-1, vocab) if soft else target.reshape(-1)
                shape = (target.shape[0], vocab)
            if len(shape) == 2 and rows_fit and (weight is None or tuple(weight.shape) == (vocab,)):
                shape, target = (min(shape[0], 1), vocab), target[:1]  # nothing depends on the rows: one
            logits = torch.empty((), dtype=_loss_dtype(hidden, upcast), device=hidden.device).expand(shape)
        F.cross_entropy(
            logits,
            target,
            weight=weight,
            reduction=reduction,
            ignore_index=-100 if ignore_index is None else ignore_index,
            label_smoothing=label_smoothing,
        )


def _check_byte_labels(target: torch.Tensor, vocab_size: int, ignore_index: int, reduction: str) -> None:
    """On CPU, eager's error for a Byte label out of range (``reduction="none"`` prints the byte as
    a character, which the tiles' check of the long labels would not): eager's loss of that one
    label raises it."""
    if target.device.type != "cpu" or torch.compiler.is_compiling() or target.numel() == 0:
        return
    labels = target.long()  # (a Byte tensor compared with -1 compares with 255)
    bad = ((labels >= vocab_size) & (labels != ignore_index)).nonzero()
    if len(bad):
        first = target[bad[0, 0] : bad[0, 0] + 1]
        F.cross_entropy(torch.zeros(1, vocab_size), first, ignore_index=ignore_index, reduction=reduction)


def _smoothing(label_smoothing) -> float:
    """The label smoothing the tiles apply: eager's ``cross_entropy`` smooths only where it is
    above 0, so a negative or NaN one (which torch's op takes, unchecked) is none."""
    value = _constant_float(label_smoothing)
    return value if value > 0.0 else 0.0


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _constant_float(value: float | None) -> float | None:
    """``value`` as a Python float, specialised if Dynamo made it symbolic (``float.hex`` needs
    the number itself; ``float(x)`` and formatting keep it symbolic)."""
    return None if value is None else float.fromhex(float(value).hex())


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(tensor, DTensor)
