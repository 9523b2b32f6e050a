"""Sequence parallelism: 2 gloo ranks, each with part of the sequence, give the global
token-weighted mean and its gradients exactly (float64 oracle: one process, whole sequence).

Token weighting across ranks is where tiled losses have gone wrong (DeepSpeed's old TiledLoss:
loss right, gradient off 0.375x-1.5x), so the cases are the masks that break a mean of means:
uneven valid counts and uneven shard lengths, a rank whose labels are all ignored, the
compiled rewrite on each rank, and the world-size factor of a differentiable all-reduce.
All cases run in one pair of processes (one spawn, a few seconds).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pathlib
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import TOLERANCES, assert_close_to_oracle

import tile_pass

WORLD = 2
_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "sequence_parallel.py"


def _load_example():
    """The example module is the code under test (not a package: load it by path)."""
    if "sequence_parallel_example" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sequence_parallel_example", _EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sequence_parallel_example"]


sp = _load_example()

# name -> (dtype, masking, how the local sum is computed, how backward is driven)
CASES = {
    "uneven_counts_f64": (torch.float64, "uneven", "direct", "share"),
    "rank1_all_ignored_f64": (torch.float64, "rank1_all_ignored", "direct", "share"),
    "rank0_all_ignored_f32": (torch.float32, "rank0_all_ignored", "direct", "share"),
    "compiled_rewrite_f64": (torch.float64, "uneven", "compiled", "share"),
    "differentiable_all_reduce_f64": (torch.float64, "uneven", "direct", "all_reduce"),
}


def case_problem(masking):
    h, w, b, labels = sp.problem(seed=3)
    if masking == "rank1_all_ignored":
        labels[:, sp.shard_bounds(labels.shape[1], 1, WORLD)] = -100
    elif masking == "rank0_all_ignored":
        labels[:, sp.shard_bounds(labels.shape[1], 0, WORLD)] = -100
    else:  # rank 0 loses most of its labels: valid counts per rank are very uneven
        labels[:, 1:5] = -100
    return h, w, b, labels


def canonical_sum(h, w, b, y):
    """The pattern the pass rewrites, reduction="sum" (no .float(): it would downcast float64)."""
    logits = F.linear(h, w, b)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum")


def _run_case(rank, dtype, masking, local, drive):
    h, w, b, labels = case_problem(masking)
    shard = sp.shard_bounds(h.shape[1], rank, WORLD)
    h_r = h[:, shard].to(dtype).clone().requires_grad_()  # each rank owns its shard
    w_r, b_r = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    y_r = labels[:, shard].contiguous()
    report = None
    if local == "compiled":
        backend = tile_pass.backend("aot_eager", tile_tokens=4)
        local_sum = torch.compile(canonical_sum, backend=backend)(h_r, w_r, b_r, y_r)
        report = backend.report().to_dict()
        count = (y_r != -100).sum()
        dist.all_reduce(count)
        loss_r = local_sum / count.clamp_min(1)
        global_loss = loss_r.detach().clone()
        dist.all_reduce(global_loss)
    else:
        loss_r, global_loss = sp.sequence_parallel_loss(h_r, w_r, y_r, b_r, tile_tokens=4)
    if drive == "all_reduce":  # differentiable global loss, backward on every rank
        differentiable = dist_nn.all_reduce(loss_r)
        torch.testing.assert_close(differentiable.detach(), global_loss)
        differentiable.backward()
    else:
        loss_r.backward()
    sp.all_reduce_grads(w_r, b_r)
    return {
        "loss": global_loss,
        "grad_h": h_r.grad,
        "grad_w": w_r.grad,
        "grad_b": b_r.grad,
        "valid": int((y_r != -100).sum()),
        "report": report,
    }


def _worker(rank, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        results = {name: _run_case(rank, *case) for name, case in CASES.items()}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("sp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        _worker, args=(port, str(outdir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("sequence-parallel workers did not finish within 120 s")
    return [torch.load(outdir / f"rank{r}.pt") for r in range(WORLD)]


def oracle(masking):
    """One process, the whole sequence, eager F.cross_entropy (mean), float64."""
    h, w, b, labels = (t.requires_grad_() if t.is_floating_point() else t for t in case_problem(masking))
    logits = F.linear(h, w, b)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("name", list(CASES))
def test_global_token_weighted_mean_and_gradients(rank_results, name):
    dtype, masking, local, drive = CASES[name]
    loss, grad_h, grad_w, grad_b = oracle(masking)
    seq = grad_h.shape[1]
    factor = WORLD if drive == "all_reduce" else 1  # dist.nn all_reduce: backward all-reduces too
    counts = [results[name]["valid"] for results in rank_results]
    assert sum(counts) > 0 and len(set(counts)) == WORLD, f"valid counts must differ per rank: {counts}"
    if masking.endswith("all_ignored"):
        assert 0 in counts
    for rank, results in enumerate(rank_results):
        got = results[name]
        assert_close_to_oracle(got["loss"], loss, dtype, f"rank {rank} loss")
        shard = sp.shard_bounds(seq, rank, WORLD)
        assert_close_to_oracle(got["grad_h"], factor * grad_h[:, shard], dtype, f"rank {rank} grad hidden")
        assert_close_to_oracle(got["grad_w"], factor * grad_w, dtype, f"rank {rank} grad weight")
        assert_close_to_oracle(got["grad_b"], factor * grad_b, dtype, f"rank {rank} grad bias")
        if local == "compiled":
            assert len(got["report"]["rewrites"]) == 1, got["report"]
            assert got["report"]["rewrites"][0]["reduction"].startswith("sum")


def test_mean_of_rank_means_would_be_wrong():
    """The check can fail: the mean of per-rank means (what a naive SP loss computes) differs
    from the token-weighted mean on the uneven case by far more than the tolerance."""
    h, w, b, labels = case_problem("uneven")
    means = []
    for rank in range(WORLD):
        shard = sp.shard_bounds(h.shape[1], rank, WORLD)
        logits = F.linear(h[:, shard], w, b)
        means.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, shard].reshape(-1)))
    naive = sum(means) / WORLD
    assert (naive - oracle("uneven")[0]).abs() > 1e3 * TOLERANCES[torch.float64]["rtol"]
