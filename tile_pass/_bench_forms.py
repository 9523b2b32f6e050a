"""The benchmark's preference and distillation forms (``--form dpo``, ``--form distill``).

Each loss is written once, as plain eager code of the kind preference and distillation trainers
write (the shape of ``tests/losses_as_written.py``), and every mode of the benchmark runs that
same code: eager, ``torch.compile`` with Inductor, tile_pass, and ``chunked``, the way users
chunk such losses by hand today: a Python loop over token chunks, each chunk's head and loss
under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, the chunk losses weighted
by the whole batch's token and pair counts and summed.

``dpo``: chosen and rejected sequences concatenated (``[2B, T, H]``), ``x @ W.t() + b`` with a
learnable ``[V]`` bias, per-token log-probabilities of all rows (``log_softmax`` + ``gather``,
masked sum per sequence), the cross entropy on the chosen half only, and the sigmoid DPO loss
of the margin against given reference log-probabilities. ``dpo_sigmoid``: the same without the
cross entropy, DPO's sigmoid loss alone (TRL's default ``loss_type="sigmoid"``), whose pairs
longer than a tile keep three GEMMs per token (:mod:`tile_pass.tiles._summary_tiles`; the NLL
term of ``dpo`` gives its chosen tokens a second gradient direction). ``distill``: a student head and a
frozen teacher head (its own hidden states, a different hidden size, same vocabulary), the
generalized Jensen-Shannon divergence (beta 0.5) between their log-softmaxes at temperature
2, averaged over the labelled tokens. ``distill_trained``: the same loss code with a teacher
that learns too (its hidden states and weight require grad): two trained heads, six GEMMs per
token at the floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
#: tokens per sequence of the ``dpo`` form (fewer where the batch has under four of them)
DPO_SEQUENCE = 256
DPO_BETA = 0.1
JSD_BETA = 0.5
JSD_TEMPERATURE = 2.0
#: the teacher's hidden size over the student's in the ``distill`` form
TEACHER_WIDTH = 1.5
#: tokens per chunk of the ``chunked`` rows (``dpo``: whole chosen/rejected pairs, at least one),
#: or a quarter of a smaller batch
CHUNK_TOKENS = 512


# ------------------------------------------------------------------ the losses, written once


def _dpo_terms(x, w, b, y, ref_chosen, ref_rejected, nll: bool = True):
    """The head and the DPO terms of ``x``'s sequences (chosen first, rejected second): the
    chosen half's summed cross entropy (``None`` without ``nll``) and log-sigmoid of each pair's
    margin."""
    logits = x @ w.t() + b
    half = x.shape[0] // 2
    vocab = logits.shape[-1]
    if nll:
        nll = F.cross_entropy(
            logits[:half].reshape(-1, vocab), y[:half].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    else:
        nll = None
    mask = y != IGNORE_INDEX
    per_token = logits.log_softmax(-1).gather(-1, torch.where(mask, y, 0).unsqueeze(-1)).squeeze(-1)
    logps = (per_token * mask).sum(-1)
    margin = DPO_BETA * ((logps[:half] - ref_chosen) - (logps[half:] - ref_rejected))
    return nll, F.logsigmoid(margin)


def _upcast(logits):
    """The float32 upcast trainers write as ``.float()``; a float64 head (the check) stays float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _jsd_tokens(hs, ws, ht, wt, y):
    """Both heads and the per-token generalized JSD between them, zero at ignored labels."""
    student = hs @ ws.t()
    teacher = ht @ wt.t()
    log_q = F.log_softmax(_upcast(student) / JSD_TEMPERATURE, dim=-1)
    log_p = F.log_softmax(_upcast(teacher) / JSD_TEMPERATURE, dim=-1)
    log_m = torch.lerp(log_q.exp(), log_p.exp(), JSD_BETA).log()
    to_teacher = F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1)
    to_student = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
    per_token = JSD_BETA * to_teacher + (1 - JSD_BETA) * to_student
    return torch.where(y != IGNORE_INDEX, per_token, 0.0)


def _sequences(hidden, labels):
    length = dpo_sequence(hidden.shape[0])
    return hidden.view(-1, length, hidden.shape[-1]), labels.view(-1, length)


def dpo(hidden, weight, labels, bias, ref_chosen, ref_rejected):
    """DPO on ``[N, H]`` hidden states viewed as ``[2B, T, H]`` (chosen, then rejected)."""
    x, y = _sequences(hidden, labels)
    nll, log_sigmoid = _dpo_terms(x, weight, bias, y, ref_chosen, ref_rejected)
    return nll / (y[: y.shape[0] // 2] != IGNORE_INDEX).sum() - log_sigmoid.mean()


def dpo_sigmoid(hidden, weight, labels, bias, ref_chosen, ref_rejected):
    """DPO's sigmoid loss alone on ``[N, H]`` hidden states viewed as ``[2B, T, H]``."""
    x, y = _sequences(hidden, labels)
    _, log_sigmoid = _dpo_terms(x, weight, bias, y, ref_chosen, ref_rejected, nll=False)
    return -log_sigmoid.mean()


def distill(hidden, weight, labels, teacher_hidden, teacher_weight):
    """The student's JSD to a frozen teacher, averaged over the labelled tokens."""
    per_token = _jsd_tokens(hidden, weight, teacher_hidden, teacher_weight, labels)
    return per_token.sum() / (labels != IGNORE_INDEX).sum()


FORMS: dict[str, Callable] = {
    "dpo": dpo, "dpo_sigmoid": dpo_sigmoid, "distill": distill, "distill_trained": distill,
}  # fmt: skip
#: the forms of chosen/rejected pairs (a bias and reference log-probabilities are their extra inputs)
DPO_FORMS = ("dpo", "dpo_sigmoid")
#: the forms with a teacher head (its hidden states and weight are the form's extra inputs)
TEACHER_FORMS = ("distill", "distill_trained")


_sequence = DPO_SEQUENCE


def use_dpo_sequence(length: int | None) -> None:
    """Sequences of ``length`` tokens in the ``dpo`` forms from now on (``None``:
    :data:`DPO_SEQUENCE`): the benchmark's ``--dpo-sequence``, for pairs longer than a tile."""
    global _sequence
    _sequence = DPO_SEQUENCE if length is None else length


def dpo_sequence(tokens: int) -> int:
    """Tokens per sequence of ``dpo`` at ``tokens`` in all: :data:`DPO_SEQUENCE` (or the length
    :func:`use_dpo_sequence` set), or a quarter of a small batch (two pairs)."""
    length = min(_sequence, tokens // 4)
    if length < 1 or tokens % (2 * length):
        raise ValueError(f"the dpo form needs whole chosen/rejected pairs of {length} tokens, not N={tokens}")
    return length


# ------------------------------------------------------------------ the step's other inputs


def form_inputs(form: str, hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    """The inputs after ``(hidden, weight, labels)``, deterministic; a learnable one (the
    ``dpo`` bias) requires grad, the teacher's do not."""
    gen = torch.Generator().manual_seed(1)
    device, dtype = hidden.device, hidden.dtype
    vocab, width = weight.shape
    if form in DPO_FORMS:
        bias = torch.randn(vocab, generator=gen) * 0.5
        _, y = _sequences(hidden, labels)
        pairs = y.shape[0] // 2
        # reference log-probabilities near the policy's (a token's is about -log V - 1/2 here)
        expected = -(y != IGNORE_INDEX).sum(-1).cpu().double() * (math.log(vocab) + 0.5)
        ref = (expected + 10 * torch.randn(2 * pairs, generator=gen, dtype=torch.float64)).to(device, dtype)
        return bias.to(device, dtype).requires_grad_(), ref[:pairs], ref[pairs:]
    if form in TEACHER_FORMS:
        teacher_width = round(width * TEACHER_WIDTH)
        teacher_hidden = torch.randn(hidden.shape[0], teacher_width, generator=gen)
        teacher_weight = torch.randn(vocab, teacher_width, generator=gen) * (2.0 / teacher_width**0.5)
        teacher = teacher_hidden.to(device, dtype), teacher_weight.to(device, dtype)
        return tuple(t.requires_grad_() for t in teacher) if form == "distill_trained" else teacher
    raise ValueError(f"unknown form {form!r}; choose from {', '.join(FORMS)}")


# ------------------------------------------------------------------ chunked, as users write it


def _dpo_chunk(x, w, b, y, ref_chosen, ref_rejected, chosen_tokens, pairs):
    nll, log_sigmoid = _dpo_terms(x, w, b, y, ref_chosen, ref_rejected)
    return nll / chosen_tokens - log_sigmoid.sum() / pairs


def _dpo_sigmoid_chunk(x, w, b, y, ref_chosen, ref_rejected, chosen_tokens, pairs):
    _, log_sigmoid = _dpo_terms(x, w, b, y, ref_chosen, ref_rejected, nll=False)
    return -log_sigmoid.sum() / pairs


def _distill_chunk(hs, ws, ht, wt, y, valid_tokens):
    return _jsd_tokens(hs, ws, ht, wt, y).sum() / valid_tokens


def chunks(form: str, hidden, weight, labels, *extra, chunk_tokens: int | None = None) -> Iterator[tuple]:
    """``(function, args)`` per chunk of ``form``'s step, whose values sum to the loss.

    Each chunk runs the form's own head and loss code on its tokens and divides by the whole
    batch's counts (labelled chosen tokens and pairs for ``dpo``, labelled tokens for
    ``distill``), so the sum is the loss of the whole batch. ``dpo`` chunks whole pairs: the
    chosen sequences ``[i, j)`` and their rejected ones, as a pair's terms need both.
    """
    if chunk_tokens is None:
        chunk_tokens = min(CHUNK_TOKENS, max(1, labels.shape[0] // 4))
    if form in DPO_FORMS:
        chunk = _dpo_chunk if form == "dpo" else _dpo_sigmoid_chunk
        bias, ref_chosen, ref_rejected = extra
        x, y = _sequences(hidden, labels)
        pairs = y.shape[0] // 2
        chosen_tokens = (y[:pairs] != IGNORE_INDEX).sum()
        step = max(1, chunk_tokens // (2 * y.shape[1]))
        for i in range(0, pairs, step):
            j = min(pairs, i + step)
            rows = torch.cat([x[i:j], x[pairs + i : pairs + j]]), weight, bias
            rows += (torch.cat([y[i:j], y[pairs + i : pairs + j]]), ref_chosen[i:j], ref_rejected[i:j])
            yield chunk, (*rows, chosen_tokens, pairs)
        return
    if form in TEACHER_FORMS:
        teacher_hidden, teacher_weight = extra
        valid_tokens = (labels != IGNORE_INDEX).sum()
        for i in range(0, labels.shape[0], chunk_tokens):
            part = slice(i, i + chunk_tokens)
            yield _distill_chunk, (hidden[part], weight, teacher_hidden[part], teacher_weight, labels[part],
                                   valid_tokens)  # fmt: skip
        return
    raise ValueError(f"the chunked rows compute {', '.join(FORMS)} only, not {form!r}")


def chunked(form: str) -> Callable:
    """``form`` chunked by hand: every chunk under ``checkpoint(..., use_reentrant=False)`` (its
    logits recomputed in backward), the chunk losses summed."""

    def chunked_loss(hidden, weight, labels, *extra):
        pieces = chunks(form, hidden, weight, labels, *extra)
        return torch.stack([checkpoint(fn, *args, use_reentrant=False) for fn, args in pieces]).sum()

    return chunked_loss


def float64_reference(form: str, hidden, weight, labels, extra, chunk_tokens: int = 256):
    """The loss and the gradients of ``hidden``, ``weight`` and each extra input that requires
    grad, in float64, one chunk of :func:`chunks` at a time (so no ``[N, V]`` float64 tensor of
    the whole batch exists; each chunk's backward runs before the next chunk's forward).

    Shares :func:`chunks`' split with the ``chunked`` rows; the eager rows (the form on the
    whole batch) checked against it would show a wrong split.
    """
    leaves = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]
    others = []
    for t in extra:
        t64 = t.detach().double() if t.is_floating_point() else t
        if t.requires_grad:
            t64.requires_grad_()
            leaves.append(t64)
        others.append(t64)
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grads = [torch.zeros_like(leaf) for leaf in leaves]
    for fn, args in chunks(form, leaves[0], leaves[1], labels, *others, chunk_tokens=chunk_tokens):
        part = fn(*args)
        for total, grad in zip(grads, torch.autograd.grad(part, leaves, allow_unused=True), strict=True):
            if grad is not None:
                total += grad
        loss += part.detach()
    return loss, grads


# ------------------------------------------------------------------ the GEMM floor


def floor_gemms(form: str, hidden, weight, grad_logits, extra) -> list[tuple[str, torch.Tensor, Any]]:
    """The GEMMs ``form``'s step cannot avoid, as ``(name, a, b)`` for ``a @ b``: the logits,
    the hidden-state gradient and the weight gradient of the trained head (the bias gradient is
    a column sum, not a GEMM), and for ``distill`` the frozen teacher's logits (forward only);
    ``distill_trained``'s teacher learns too: its logits and both its gradients (six in all)."""
    gemms = [("h @ W.T", hidden, weight.T), ("dlogits @ W", grad_logits, weight),
             ("dlogits.T @ h", grad_logits.T, hidden)]  # fmt: skip
    if form in TEACHER_FORMS:
        teacher_hidden, teacher_weight = extra
        gemms.append(("teacher h @ W.T", teacher_hidden, teacher_weight.T))
    if form == "distill_trained":
        gemms += [("teacher dlogits @ W", grad_logits, teacher_weight),
                  ("teacher dlogits.T @ h", grad_logits.T, teacher_hidden)]  # fmt: skip
    return gemms
