"""TRL's GRPO loss as its code writes it, on hidden states and an LM-head weight.

* :func:`grpo_trl`: slice the logits to the completion's predictions (``logits[:, :-1, :]``),
  divide by the sampling temperature, ``log_softmax``, ``gather`` the completion ids, the
  clipped-ratio-free policy-gradient term ``-exp(logp - logp.detach()) * advantage`` masked by
  the completion mask and averaged per sequence, then over the batch.
* :func:`grpo_selective`: the same through TRL's own ``selective_log_softmax`` (a gather and a
  ``logsumexp`` looped over the batch rows in float32, a ``log_softmax`` looped over the rows in
  bfloat16), which is what TRL's trainers call when they compute log-probs from logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TEMPERATURE = 0.7


def _policy_loss(logps, mask, advantages):
    per_token = -torch.exp(logps - logps.detach()) * advantages.unsqueeze(1)
    m = mask[:, 1:]
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def grpo_trl(logits, ids, mask, advantages):
    logits = logits[:, :-1, :]
    logits = logits / TEMPERATURE
    logps = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return _policy_loss(logps, mask, advantages)


def grpo_selective(logits, ids, mask, advantages):
    from trl.trainer.utils import selective_log_softmax

    logps = selective_log_softmax(logits[:, :-1, :], ids[:, 1:], temperature=TEMPERATURE)
    return _policy_loss(logps, mask, advantages)


FORMS = {"grpo_trl": grpo_trl, "grpo_selective": grpo_selective}


def batch(batch_size: int, tokens: int, vocab: int, seed: int = 0):
    """Completion ids, a completion mask with a fully masked sequence, and advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, tokens), generator=g)
    mask = (torch.rand(batch_size, tokens, generator=g) > 0.3).float()
    mask[0, : tokens // 2] = 0  # a masked prompt
    mask[-1] = 0  # a sequence with no completion token
    advantages = torch.randn(batch_size, generator=g)
    return ids, mask, advantages


def on_head(form):
    def step(hidden, weight, ids, mask, advantages):
        return form(F.linear(hidden, weight), ids, mask, advantages)

    step.__name__ = form.__name__
    return step
