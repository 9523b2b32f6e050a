"""Small loss heads written the ways users write them, one per canonical form."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H = 29, 16


def f_linear_view_float(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits.view(-1, V).float(), y.view(-1))


def matmul_t_flatten_to_sum(h, w, y):
    logits = h @ w.t()
    return F.cross_entropy(logits.flatten(0, 1).to(torch.float32), y.reshape(-1), reduction="sum")


def torch_matmul_T_contiguous_smoothing(h, w, y):
    logits = torch.matmul(h, w.T).contiguous()
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), label_smoothing=0.1)


def eight_positional(h, w, y):
    """The form nn.CrossEntropyLoss produces, with ignore_index=5 (labels -100 become 5)."""
    logits = F.linear(h, w).view(-1, V)
    y = torch.where(y < 0, 5, y)
    return F.cross_entropy(logits, y.view(-1), None, None, 5, None, "mean", 0.05)


def none_then_weighted_sum(h, w, y):
    per_token = F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="none")
    weights = torch.linspace(0.5, 2.0, per_token.shape[0], device=per_token.device)
    return (per_token * weights).sum() / 7.0


def scaled_loss(h, w, y):
    y = torch.where(y < 0, 3, y)
    loss = F.cross_entropy(torch.matmul(h, w.mT).view(-1, V), y.view(-1), ignore_index=3)
    return loss * 3.7


def with_bias(h, w, y, b):
    logits = F.linear(h, w, b)
    return F.cross_entropy(logits.view(-1, V).float(), y.view(-1))


FORMS = [
    f_linear_view_float,
    matmul_t_flatten_to_sum,
    torch_matmul_T_contiguous_smoothing,
    eight_positional,
    none_then_weighted_sum,
    scaled_loss,
]


class TinyLM(nn.Module):
    """Embedding -> MLP block -> LM head (optionally tied), loss through nn.CrossEntropyLoss."""

    def __init__(self, vocab=V, hidden=H, tied=False, bias=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, tokens, labels):
        hidden = self.block(self.embed(tokens))
        logits = self.lm_head(hidden).float()
        return self.loss_fn(logits.view(-1, logits.shape[-1]), labels.view(-1))


def cli_example():
    """For ``python -m tile_pass explain tests/models.py:cli_example``: returns (fn, args)."""
    g = torch.Generator().manual_seed(0)
    return f_linear_view_float, (torch.randn(2, 5, H, generator=g), torch.randn(V, H, generator=g),
                                 torch.randint(0, V, (2, 5), generator=g))  # fmt: skip
