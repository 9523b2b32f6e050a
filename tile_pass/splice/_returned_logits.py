"""Logits that are also returned: exact values, a gradient path only when it is used.

When a graph returns the logits beside the loss (every Hugging Face ``*ForCausalLM``),
AOTAutograd would give the compiled backward an ``[N, V]`` tangent for them, materialised
as zeros when the caller never uses the logits' gradient, and run two GEMMs on it. Instead
the rewritten graph returns the logits *detached*, plus the tensors they were computed
from, and :func:`rebuild_outputs` re-attaches them to autograd through :class:`_LogitsGrad`:
a node that autograd only runs if a gradient reaches the logits, and whose backward is the
vector-Jacobian product of the copied forward code (derived with ``torch.autograd.grad``).

With ``drop_logits=True`` (opt-in) the logits are not computed at all; a zero-byte NaN
placeholder of the right shape and dtype stands in, so any use of it is visibly wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReturnedLogits:
    """How to rebuild a graph output that the rewrite detached or dropped (see backend)."""

    output_index: int
    extra_outputs: list[int]  # positions in the extra outputs: hidden, weight, bias, operands
    prefix: torch.fx.GraphModule | None  # (hidden, weight, bias?, *operands) -> logits; exact
    vocab_size: int | None = None  # dropped: placeholder shape [*hidden.shape[:-1], V]
    dtype: torch.dtype | None = None
    has_bias: bool = False


class _LogitsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prefix, logits, *inputs):
        ctx.prefix = prefix
        ctx.save_for_backward(*inputs)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad_logits):
        # Derived, not a hand-written formula: the vector-Jacobian product of the copied
        # forward code (the region's projection and row-wise ops), by torch.autograd.grad.
        # Under create_graph=True (grad mode is on in backward only then) the replay runs on
        # the saved inputs themselves, so the derived gradient is differentiable in turn.
        inputs = ctx.saved_tensors
        wanted = [i for i, needs in enumerate(ctx.needs_input_grad[2:]) if needs]
        grads = [None] * len(inputs)
        if grad_logits is not None and wanted:
            higher_order = torch.is_grad_enabled()
            with torch.enable_grad():
                replay = [
                    t if higher_order else t.detach().requires_grad_(i in wanted)
                    for i, t in enumerate(inputs)
                ]
                logits = ctx.prefix(*replay)
                derived = torch.autograd.grad(
                    logits, [replay[i] for i in wanted], grad_logits, create_graph=higher_order
                )
            for i, g in zip(wanted, derived, strict=True):
                grads[i] = g
        return (None, None, *grads)


def rebuild_outputs(outputs, num_outputs: int, records: list[ReturnedLogits]):
    """The original outputs of a rewritten graph from the outputs of its compiled version."""
    values = list(outputs[:num_outputs])
    extras = outputs[num_outputs:]
    for record in records:
        inputs, at = [extras[i] for i in record.extra_outputs], record.output_index
        if record.prefix is None:  # dropped
            hidden = inputs[0]
            nan = torch.full((), float("nan"), dtype=record.dtype, device=hidden.device)
            values[at] = nan.expand(*hidden.shape[:-1], record.vocab_size)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            values[at] = _LogitsGrad.apply(record.prefix, values[at], *inputs)
    return type(outputs)(values) if isinstance(outputs, tuple) else values
