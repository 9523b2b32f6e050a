"""What the loss ops return beside their values: the accumulation dtype, the gradients
each op returns (an empty tensor where one is not needed, as a custom op must return a
tensor), their fakes for tracing, and the split sum's rounding on the last tile."""

from __future__ import annotations

import contextlib

import torch

from tile_pass import _weight_grad


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Sums are float32 (float64 for float64 inputs, so a float64 oracle check is exact)."""
    return torch.promote_types(torch.float32, hidden.dtype)


def last_add_if(last: bool, weight_acc):
    """Inside the last tile of a split sum, its add rounds the sum (:func:`_weight_grad.last_add`)."""
    return _weight_grad.last_add(weight_acc[0]) if last else contextlib.nullcontext()


def empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def grads_or_empty(hidden, weight, bias, grad_h, grad_w, grad_b):
    return (
        grad_h if grad_h is not None else empty(hidden),
        grad_w.to(weight.dtype) if grad_w is not None else empty(weight),
        grad_b.to(bias.dtype) if grad_b is not None else empty(weight),
    )


def fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    """What the real implementations return: contiguous gradients, whatever the inputs' layout
    (a transposed weight's gradient is the contiguous ``[V, H]`` sum, as the tiles form it)."""
    return (
        hidden.new_empty(hidden.shape) if need_hidden else empty(hidden),
        weight.new_empty(weight.shape) if need_weight else empty(weight),
        bias.new_empty(bias.shape) if need_bias else empty(weight),
    )
