"""Sequence-parallel, token-weighted LM loss with tile_pass: 2 gloo ranks on CPU.

``python examples/sequence_parallel.py`` spawns 2 processes; each holds half of the sequence
(the labels are shifted *before* sharding, so no label is lost at the shard boundary), and
computes the global token-weighted mean loss and its gradients without ever gathering the
hidden states or making the ``[tokens, vocab]`` logits:

    local_sum = tile_pass.linear_cross_entropy(h_r, W, y_r, reduction="sum")
    count     = all_reduce(#valid labels on this rank)        # an integer: no gradient
    loss_r    = local_sum / count                              # this rank's share of the mean
    loss_r.backward()                                          # exact dL/dh_r for L = sum_r loss_r
    all_reduce(W.grad, SUM)                                    # W's gradient: sum of the shares

A mean of per-rank means would weight a rank with 1 valid token like a rank with 1000
(and a rank with none would give NaN); dividing every rank's sum by the *global* count is
the token-weighted mean. Which reductions need a gradient: ``count`` is an integer, so none;
``W.grad`` is summed after backward like DDP does (SUM, not DDP's average). If you want the
global loss as a differentiable tensor on every rank, ``torch.distributed.nn.functional.
all_reduce(loss_r)`` gives it, but its backward all-reduces the incoming gradient, so a
``backward()`` on every rank gives ``world_size`` times each gradient; that factor is exactly
cancelled when DDP/FSDP then *average* parameter gradients over the same ranks.

The script checks itself against one process computing the loss on the whole sequence in
float64 and prints the errors.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tile_pass

WORLD = 2


def shift_labels(tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels[:, t] = tokens[:, t + 1]``; the last position has no next token."""
    labels = torch.full_like(tokens, ignore_index)
    labels[:, :-1] = tokens[:, 1:]
    return labels


def shard_bounds(seq_len: int, rank: int, world: int) -> slice:
    """Contiguous sequence shards; the first ``seq_len % world`` ranks get one more position."""
    base, extra = divmod(seq_len, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def sequence_parallel_loss(
    hidden_shard: torch.Tensor,
    weight: torch.Tensor,
    labels_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
    **tile_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_r, global_loss)``: backward ``loss_r`` on every rank, log ``global_loss``.

    ``loss_r`` is this rank's share of the global token-weighted mean (its loss sum over the
    global valid-token count); the shares add up to the mean, so ``loss_r.backward()`` gives
    each hidden shard its exact gradient, and the weight's gradients summed over ranks are
    the weight's gradient. A batch with no valid label anywhere gives 0 (eager gives NaN).
    """
    local_sum = tile_pass.linear_cross_entropy(
        hidden_shard, weight, labels_shard, bias, ignore_index=ignore_index, reduction="sum",
        **tile_options,
    )  # fmt: skip
    count = (labels_shard != ignore_index).sum()
    dist.all_reduce(count, group=group)
    loss_r = local_sum / count.clamp_min(1)
    global_loss = loss_r.detach().clone()
    dist.all_reduce(global_loss, group=group)
    return loss_r, global_loss


def all_reduce_grads(*params: torch.Tensor | None, group: dist.ProcessGroup | None = None) -> None:
    """Sum the parameters' gradients over the sequence-parallel ranks (in place)."""
    for p in params:
        if p is not None and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def problem(seed: int = 0, batch: int = 2, seq: int = 11, hidden: int = 16, vocab: int = 37):
    """Hidden states, LM-head weight and bias, pre-shifted labels with some ignored, float64."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / 4
    b = torch.randn(vocab, generator=g, dtype=torch.float64) / 4
    labels = shift_labels(torch.randint(0, vocab, (batch, seq), generator=g))
    labels[0, 2:5] = -100  # a masked span (e.g. a prompt)
    return h, w, b, labels


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        h, w, b, labels = problem()
        shard = shard_bounds(h.shape[1], rank, WORLD)
        h_r = h[:, shard].detach().clone().requires_grad_()
        w_r, b_r = w.clone().requires_grad_(), b.clone().requires_grad_()
        loss_r, global_loss = sequence_parallel_loss(h_r, w_r, labels[:, shard], b_r, tile_tokens=4)
        loss_r.backward()
        all_reduce_grads(w_r, b_r)

        # the single-process reference: the whole sequence, eager F.cross_entropy, float64
        h_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (h, w, b))
        logits = F.linear(h_ref, w_ref, b_ref)
        ref = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        ref.backward()
        errors = {
            "loss": (global_loss - ref).abs().item(),
            "grad hidden shard": (h_r.grad - h_ref.grad[:, shard]).abs().max().item(),
            "grad weight": (w_r.grad - w_ref.grad).abs().max().item(),
            "grad bias": (b_r.grad - b_ref.grad).abs().max().item(),
        }
        valid = int((labels[:, shard] != -100).sum())
        print(f"rank {rank}: {valid} valid labels, loss {global_loss.item():.6f}, max abs errors {errors}")
        assert max(errors.values()) < 1e-10, errors
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"spawning {WORLD} gloo ranks (each imports torch, then checks itself) ...", flush=True)
    mp.start_processes(_worker, args=(port,), nprocs=WORLD, start_method="spawn")
    print("sequence-parallel loss and gradients equal the single-process float64 reference")


if __name__ == "__main__":
    main()
