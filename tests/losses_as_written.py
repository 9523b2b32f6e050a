"""Preference, RL and distillation losses as people write them for eager PyTorch.

Each follows the shape of the eager reference implementations that training libraries test
their fused kernels against: chosen and rejected sequences concatenated along the batch, a
bias added after the matmul, an NLL term or a logits metric on the chosen half only, an
in-place temperature after another reader, and a student and a frozen teacher head combined
row by row. Nothing here is written for tile_pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _batch_logps(logits, labels, average=False):
    """Per-sequence log-probabilities of the labels, masked (the usual ``get_batch_logps``)."""
    mask = labels != IGNORE
    labels = torch.where(mask, labels, 0)
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average:
        return (per_token * mask).sum(-1) / mask.sum(-1)
    return (per_token * mask).sum(-1)


def _concatenated(x, w, b, y):
    """``[2B, T, V]`` float logits of chosen-then-rejected sequences and the chosen NLL."""
    logits = x @ w.t()
    if b is not None:
        logits = logits + b
    logits = logits.float()
    half = x.shape[0] // 2
    nll = F.cross_entropy(
        logits[:half].reshape(-1, logits.shape[-1]), y[:half].reshape(-1), ignore_index=IGNORE
    )
    return logits, half, nll


def dpo(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    logits, half, nll = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    chosen, rejected = logps[:half], logps[half:]
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    loss = nll - F.logsigmoid(margin).mean()
    return loss, logits[:half].mean(), logits[half:].mean()


def orpo(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    logits, half, nll = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y, average=True)
    chosen, rejected = logps[:half], logps[half:]
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return nll - beta * F.logsigmoid(log_odds).mean(), logits[:half].mean(), logits[half:].mean()


def simpo(x, w, b, y, ref_chosen, ref_rejected, beta=2.0, gamma=0.5):
    logits, half, nll = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y, average=True)
    chosen, rejected = logps[:half], logps[half:]
    return -F.logsigmoid(beta * (chosen - rejected) - gamma).mean(), logits[:half].mean()


def dpo_shifted(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """Log-probs of the next token (``logits[:, :-1]``) on all rows, the NLL on the chosen half."""
    logits, half, nll = _concatenated(x, w, b, y)
    logps = _batch_logps(logits[:, :-1, :], y[:, 1:])
    chosen, rejected = logps[:half], logps[half:]
    return nll - F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()


def kto(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """Desirable first half, undesirable second half; a KL baseline of zero."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    chosen, rejected = logps[:half] - ref_chosen, logps[half:] - ref_rejected
    losses = torch.cat([1 - F.sigmoid(beta * chosen), 1 - F.sigmoid(-beta * rejected)])
    return losses.mean()


def grpo(x, w, b, y, old_logps, advantages, beta=0.04, eps=0.2):
    logits = x @ w.t()
    if b is not None:
        logits = logits + b
    logits = logits.float()
    logps = torch.gather(logits.log_softmax(-1), 2, torch.where(y == IGNORE, 0, y).unsqueeze(-1)).squeeze(-1)
    mask = (y != IGNORE).float()
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    per_token = per_token + beta * (torch.exp(old_logps - logps) - (old_logps - logps) - 1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _jsd(log_q, log_p, beta):
    """Generalised JSD between the student ``q`` and the teacher ``p`` (log-probabilities, [N, V])."""
    if beta == 0:
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    m = torch.lerp(torch.exp(log_q), torch.exp(log_p), beta)
    log_m = torch.log(m)
    return beta * F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1) + (1 - beta) * F.kl_div(
        log_m, log_q, reduction="none", log_target=True
    ).sum(-1)


def distill_jsd(hs, ws, ht, wt, y, beta=0.5, temperature=2.0, hard_weight=0.5, soft_weight=0.5):
    """Student and teacher heads, a hard CE, then the temperature applied in place."""
    student_logits = hs @ ws.t()
    teacher_logits = ht @ wt.t()
    V = student_logits.shape[-1]
    hard = F.cross_entropy(student_logits.view(-1, V), y.view(-1), ignore_index=IGNORE)
    student_logits /= temperature
    teacher_logits /= temperature
    log_q = F.log_softmax(student_logits.float(), dim=-1).view(-1, V)
    log_p = F.log_softmax(teacher_logits.float(), dim=-1).view(-1, V)
    per_token = _jsd(log_q, log_p, beta)
    valid = y.view(-1) != IGNORE
    soft = torch.where(valid, per_token, 0.0).sum() / valid.sum()
    return hard_weight * hard + soft_weight * soft


def distill_forward_kl(hs, ws, ht, wt, y, temperature=1.0):
    student = (hs @ ws.t()).float() / temperature
    teacher = (ht @ wt.t()).float() / temperature
    V = student.shape[-1]
    teacher_probs = F.softmax(teacher, dim=-1).view(-1, V)
    student_logp = F.log_softmax(student, dim=-1).view(-1, V)
    per_token = (teacher_probs * (teacher_probs.clamp_min(1e-30).log() - student_logp)).sum(-1)
    mask = y.view(-1) != IGNORE
    return (per_token * mask).sum() / mask.sum()


def distill_reverse_kl(hs, ws, ht, wt, y, temperature=1.0):
    student = F.linear(hs, ws).float() / temperature
    teacher = F.linear(ht, wt).float() / temperature
    V = student.shape[-1]
    log_q = student.log_softmax(-1).view(-1, V)
    log_p = teacher.log_softmax(-1).view(-1, V)
    return F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)


def distill_kl_div(hs, ws, ht, wt, y, reduction="sum", temperature=2.0):
    """``F.kl_div`` of the student's log-probabilities from the teacher's probabilities, masked."""
    V = ws.shape[0]
    student = F.log_softmax((hs @ ws.t()).float().view(-1, V) / temperature, dim=-1)
    with torch.no_grad():
        teacher = F.softmax((ht @ wt.t()).float().view(-1, V) / temperature, dim=-1)
    valid = (y.view(-1) != IGNORE).unsqueeze(-1)
    return F.kl_div(student * valid, teacher * valid, reduction=reduction) * temperature**2


def cpo_chunked(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """The batch taken apart with ``chunk``: NLL on the chosen half, a metric on each half."""
    logits = x @ w.t()
    if b is not None:
        logits = logits + b
    logits = logits.float()
    chosen_logits, rejected_logits = logits.chunk(2)
    V = logits.shape[-1]
    half = x.shape[0] // 2
    nll = F.cross_entropy(chosen_logits.reshape(-1, V), y[:half].reshape(-1), ignore_index=IGNORE)
    logps = _batch_logps(logits, y)
    loss = nll - F.logsigmoid(beta * (logps[:half] - logps[half:])).mean()
    return loss, chosen_logits.mean(), rejected_logits.mean()


def dpo_nll_last(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """The chosen half's NLL sliced after the log-probs of all rows were taken (the other order)."""
    logits = (x @ w.t() + b).float()
    logps = _batch_logps(logits, y)
    half = x.shape[0] // 2
    V = logits.shape[-1]
    nll = F.cross_entropy(logits[:half].reshape(-1, V), y[:half].reshape(-1), ignore_index=IGNORE)
    return nll - F.logsigmoid(beta * ((logps[:half] - ref_chosen) - (logps[half:] - ref_rejected))).mean()


def dpo_split_narrow(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """``split`` for the metrics, ``narrow`` for the NLL."""
    logits = F.linear(x, w, b).float()
    half = x.shape[0] // 2
    V = logits.shape[-1]
    nll = F.cross_entropy(logits.narrow(0, 0, half).reshape(-1, V), y[:half].reshape(-1), ignore_index=IGNORE)
    chosen, rejected = logits.split(half)
    logps = _batch_logps(logits, y)
    margin = beta * ((logps[:half] - ref_chosen) - (logps[half:] - ref_rejected))
    return (
        nll
        - F.logsigmoid(margin).mean()
        + 0.01 * (chosen.logsumexp(-1).mean() - rejected.logsumexp(-1).mean())
    )


# ------------------------------------------------------------ one scalar, nonlinear in the tokens


def dpo_loss_only(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """DPO as a trainer's ``compute_loss`` returns it: one scalar, nothing else read."""
    return dpo(x, w, b, y, ref_chosen, ref_rejected, beta)[0]


def ipo_loss_only(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """IPO: the squared distance of the length-averaged margin from ``1 / (2 beta)``."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y, average=True)
    margin = (logps[:half] - ref_chosen) - (logps[half:] - ref_rejected)
    return ((margin - 1 / (2 * beta)) ** 2).mean()


def orpo_loss_only(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    return orpo(x, w, b, y, ref_chosen, ref_rejected, beta)[0]


def simpo_chunk_pairs(x, w, b, y, ref_chosen, ref_rejected, beta=2.0, gamma=0.5):
    """SimPO with the halves taken by ``chunk`` and a hinge (``relu``) on the margin."""
    logits, _, _ = _concatenated(x, w, b, y)
    chosen, rejected = _batch_logps(logits, y, average=True).chunk(2)
    return F.relu(gamma - beta * (chosen - rejected)).mean() - F.logsigmoid(beta * (chosen - rejected)).mean()


def batch_softmax_weighted(x, w, b, y, ref_chosen, ref_rejected):
    """Every sequence weighted by a softmax over the whole batch's log-probabilities: every token
    is coupled to every other, so no tile can hold its group (two passes over the tiles)."""
    logits, _, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    return -(logps.softmax(0) * logps).sum()


def worst_pair(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """Only the worst pair's margin counts (``max`` over the pairs): every pair is coupled to
    every other through the comparison, so no tile may hold less than the batch."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    return -F.logsigmoid(beta * (logps[:half] - logps[half:])).min()


def chosen_gate(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """A term switched by a comparison of each pair's own log-probabilities (``torch.where``):
    piecewise, so its gradient depends on the pair's values; pairs stay apart."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    margin = logps[:half] - logps[half:]
    return torch.where(margin > 0, margin * 0.1, -F.logsigmoid(beta * margin)).sum()


def distill_teacher_first(hs, ws, ht, wt, y, temperature=2.0):
    """The frozen teacher's head computed before the student's (its own region, tried first,
    stops at the student; the student's region then takes it as its second head)."""
    with torch.no_grad():
        teacher = (ht @ wt.t()).float() / temperature
    student = (hs @ ws.t()).float() / temperature
    V = student.shape[-1]
    per_token = F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), reduction="none", log_target=True)
    mask = (y != IGNORE).unsqueeze(-1)
    return (per_token * mask).sum() / mask.sum() * temperature**2 / V


def dpo_with_rewards(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """DPO as preference trainers return it: the loss, and each pair's detached rewards (what
    they log as ``rewards/chosen`` and ``rewards/margins``)."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    chosen, rejected = logps[:half] - ref_chosen, logps[half:] - ref_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def dpo_margin_in_place(x, w, b, y, ref_chosen, ref_rejected, beta=0.1):
    """The reference log-ratios added to the margin in place: replayed out of place before
    matching (``match/_functionalize.py``), so the pairs are coupled as in ``dpo``."""
    logits, half, _ = _concatenated(x, w, b, y)
    logps = _batch_logps(logits, y)
    margin = logps[:half] - logps[half:]
    margin += ref_rejected - ref_chosen
    return -F.logsigmoid(beta * margin).mean()
