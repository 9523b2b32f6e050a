"""Per-rank peak memory of a vocabulary-sharded LM-head step on 2 gloo ranks (CPU).

    python examples/tensor_parallel_memory.py [--tokens 4096 --hidden 128 --vocab 32000]

Four steps, each in freshly spawned ranks so that no allocator state carries over:

* ``loss_parallel``: torchtitan's recipe, eager: the head parallelised with
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` and the cross entropy
  under ``loss_parallel()`` (each rank holds its ``[N, V/2]`` logits and their log-probs);
* ``inductor``: the same step, its loss compiled by plain Inductor (``loss_parallel()`` around it);
* ``tile_pass backend``: the same, compiled with ``tile_pass.backend("inductor")``: the pass
  rewrites the head and the loss into the tiled vocabulary-parallel loss;
* ``tile_pass``: ``tile_pass.linear_cross_entropy(hidden, weight, labels)`` with the same
  ``Shard(0)`` DTensor weight: each rank tiles its shard.

Peak = VmHWM after the step minus the resident size before it (``/proc/self/clear_refs``),
per rank; the losses of both steps are printed to show they agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _worker(rank, port, impl, shape, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    import tile_pass

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (WORLD,))
    n, h, v = shape
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g) / h**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    if impl in ("loss_parallel", "inductor", "tile_pass backend"):
        head = torch.nn.Linear(h, v, bias=False)
        head.weight.data.copy_(weight)
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))

        def loss_of(hidden, labels):
            return F.cross_entropy(head(hidden), labels)

        if impl != "loss_parallel":
            backend = "inductor" if impl == "inductor" else tile_pass.backend("inductor")
            loss_of = torch.compile(loss_of, backend=backend)

        def step():
            with loss_parallel():
                loss = loss_of(hidden, labels)
                loss.backward()
            return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    else:
        w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))

        def step():
            loss = tile_pass.linear_cross_entropy(hidden, w, labels)
            loss.backward()
            return loss

    step()  # warm-up: traces the tile functions, allocates gradients
    hidden.grad = None
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _rss_kib("VmRSS")
    loss = step()
    peak = _rss_kib("VmHWM") - before
    with open(os.path.join(out, f"{impl}_{rank}.json"), "w") as f:
        json.dump({"loss": float(loss.detach()), "peak_mib": peak / 1024}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    shape = (args.tokens, args.hidden, args.vocab)
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")  # freed tensors leave RSS
    local_logits_mib = args.tokens * (args.vocab / WORLD) * 4 / 2**20
    print(f"N={args.tokens} H={args.hidden} V={args.vocab} float32, {WORLD} ranks: "
          f"local fp32 logits {local_logits_mib:.0f} MiB per rank")  # fmt: skip
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for impl in ("loss_parallel", "inductor", "tile_pass backend", "tile_pass"):
            print(f"{impl}: spawning {WORLD} fresh ranks for one step ...", file=sys.stderr, flush=True)
            mp.spawn(_worker, args=(_free_port(), impl, shape, out), nprocs=WORLD)
            rows[impl] = [json.load(open(os.path.join(out, f"{impl}_{r}.json"))) for r in range(WORLD)]
    base = max(r["peak_mib"] for r in rows["inductor"])
    print("| step | loss | peak MiB per rank | x inductor |")
    print("|---|---|---|---|")
    for impl, results in rows.items():
        peaks = " / ".join(f"{r['peak_mib']:.0f}" for r in results)
        ratio = max(r["peak_mib"] for r in results) / base
        print(f"| {impl} | {results[0]['loss']:.6f} | {peaks} | {ratio:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
