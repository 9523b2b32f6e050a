"""tile_pass in one minute: compile a small language model, check it against eager, measure it.

    python examples/demo.py            # inner compiler: inductor
    python examples/demo.py --inner aot_eager

Prints what the pass rewrote, the loss and every parameter gradient against eager (float64),
and the peak memory of one training step with plain torch.compile and with tile_pass, each
measured in a fresh process.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tile_pass
from tile_pass._measure import allocator_steady_state, peak_memory, reset_peak_memory, run_fresh

VOCAB, HIDDEN, BATCH, SEQ = 32000, 256, 4, 1024  # 4096 tokens: fp32 logits = 500 MiB


class SmallLM(nn.Module):
    """An unmodified, ordinary LM: embedding, two MLP blocks, untied LM head, HF-style loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                          nn.Linear(4 * HIDDEN, HIDDEN))
            for _ in range(2)
        )  # fmt: skip
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        logits = self.lm_head(self.norm(x))
        logits = logits.float()
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    labels[0, : SEQ // 2] = -100  # a prompt we do not train on: uneven valid tokens per tile
    return tokens, labels


def measure_child(mode: str, inner: str) -> None:
    """One training step in this (fresh) process; prints JSON."""
    torch.manual_seed(0)
    model = SmallLM()
    tokens, labels = batch()
    backend = tile_pass.backend(inner) if mode == "tile_pass" else inner
    step_fn = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        loss = step_fn(tokens, labels)
        loss.backward()
        return loss

    step()  # compile and warm up
    model.zero_grad(set_to_none=True)
    base = reset_peak_memory(torch.device("cpu"))
    step()
    peak = peak_memory(torch.device("cpu")) - base
    allocator_steady_state()  # time a step as a long-running process would run it
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    print(json.dumps({"loss": float(loss), "peak_mib": peak / 2**20, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--child", choices=["plain", "tile_pass"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure_child(args.child, args.inner)

    torch.manual_seed(0)
    model = SmallLM()
    oracle = copy.deepcopy(model).double()
    tokens, labels = batch()

    report = tile_pass.backend(args.inner).explain(model, tokens, labels)
    print(report, "\n")

    compiled = torch.compile(model, backend=tile_pass.backend(args.inner))
    loss = compiled(tokens, labels)
    loss.backward()
    ref = oracle(tokens, labels)
    ref.backward()
    print(f"loss   tile_pass {loss.item():.8f}   eager float64 {ref.item():.8f}")
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), oracle.named_parameters(), strict=True):
        err = ((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
        worst = max(worst, err)
        print(f"grad   {name:<28} max relative error vs eager float64: {err:.2e}")
    print()

    results = {}
    for mode in ("plain", "tile_pass"):
        script = [__file__, "--child", mode, "--inner", args.inner]
        results[mode] = run_fresh(script)
    plain, tiled = results["plain"], results["tile_pass"]
    logits_mib = BATCH * SEQ * VOCAB * 4 / 2**20
    print(f"one training step, {BATCH * SEQ} tokens, vocab {VOCAB} (fp32 logits {logits_mib:.0f} MiB),")
    print(f"peak memory above the model and batch, each in a fresh process, inner={args.inner}:")
    print(f"  torch.compile             {plain['peak_mib']:8.0f} MiB  {plain['seconds']:6.2f} s/step")
    print(f"  torch.compile + tile_pass {tiled['peak_mib']:8.0f} MiB  {tiled['seconds']:6.2f} s/step")
    print(f"  memory ratio {tiled['peak_mib'] / plain['peak_mib']:.2f}x, "
          f"time ratio {tiled['seconds'] / plain['seconds']:.2f}x")  # fmt: skip
    if worst > 1e-4 or not report.rewrites:
        sys.exit("tile_pass demo: the rewrite did not happen or gradients disagree")


if __name__ == "__main__":
    main()
