"""tile_pass in about a minute: compile a small language model, check it against eager, measure it.

    python examples/demo.py            # inner compiler: inductor
    python examples/demo.py --inner aot_eager

An ordinary small LM (embedding, two MLP blocks, an untied LM head, cross entropy; 2048 tokens,
vocabulary 32000) is compiled twice: with plain ``torch.compile`` and with tile_pass. The demo
prints what the pass rewrote; the loss and every parameter gradient of both against eager in
float64; the step time of each, from steps after a warm-up timed in interleaved rounds (one step
of each mode per round, the order alternating, so a slow spell of a shared machine slows both;
medians with their min-max, as ``tile_pass.bench --interleave`` times); and the peak memory of
a training step of each, in a process that has run nothing else (``VmHWM`` after a reset,
above the resident size before the step, the allocator pinned to return freed memory:
``tile_pass._measure``): tile_pass's in this process, measured before anything else runs in
it, torch.compile's in a fresh child process that runs meanwhile. Each phase says what it is
doing when it starts, and every 10 s while it lasts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

import tile_pass
from tile_pass._measure import allocator_steady_state, peak_memory, reset_peak_memory, run_fresh, timed

VOCAB, HIDDEN, BATCH, SEQ = 32000, 256, 2, 1024  # 2048 tokens: fp32 logits = 250 MiB
MODES = ("torch.compile", "tile_pass")
CPU = torch.device("cpu")
_START = time.perf_counter()


def say(text: str) -> None:
    """Print now (not when the buffer fills), with the seconds since the start."""
    print(f"[{time.perf_counter() - _START:5.1f} s] {text}", flush=True)


@contextlib.contextmanager
def phase(text: str, every: float = 10.0):
    """Say what starts, then how long it has been running every ``every`` seconds, then that it ended."""
    say(text + " ...")
    start, done = time.perf_counter(), threading.Event()

    def tick():
        while not done.wait(every):
            say(f"    still at it, {time.perf_counter() - start:.0f} s")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        say(f"    done in {time.perf_counter() - start:.1f} s")


def pin_allocator() -> None:
    """What a fresh measuring process gets from ``tile_pass._measure.FRESH_PROCESS_ENV``: glibc
    maps every block above 64 KiB on its own and returns freed memory at once, so the resident
    size before a step is a true baseline for its peak."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the peak may read low
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD


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


def compiled_step(model: nn.Module, mode: str, inner: str):
    """``(step, backend)``: one forward + backward of ``model`` compiled as ``mode`` says."""
    backend = tile_pass.backend(inner) if mode == "tile_pass" else inner
    compiled = torch.compile(model, backend=backend)
    tokens, labels = batch()

    def step():
        model.zero_grad(set_to_none=True)
        loss = compiled(tokens, labels)
        loss.backward()
        return loss

    return step, backend


def memory_peaks(step, steps: int) -> list[float]:
    """MiB above the resident size before each of ``steps`` steps of a compiled ``step``, after a
    warm-up step."""
    step()
    peaks = []
    for _ in range(steps):
        base = reset_peak_memory(CPU)
        step()
        peaks.append((peak_memory(CPU) - base) / 2**20)
    return peaks


def measure_child(mode: str, inner: str, steps: int) -> None:
    """The peak memory of ``mode``'s step in this fresh process (``run_fresh``); prints JSON."""
    torch.manual_seed(0)
    step, _ = compiled_step(SmallLM(), mode, inner)
    step()  # compile
    print(json.dumps({"peak_mib": memory_peaks(step, steps)}))


def relative_errors(model: nn.Module, oracle: nn.Module) -> list[float]:
    """Each parameter gradient's largest error, relative to the float64 gradient's largest magnitude."""
    pairs = zip(model.parameters(), oracle.parameters(), strict=True)
    return [((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item() for p, q in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps a mode, interleaved (3 or more)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps measured for peak memory a mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure_child(args.child, args.inner, args.memory_steps)
    rounds = max(3, args.rounds)
    pin_allocator()  # before anything is allocated for the memory measurement of tile_pass's step

    logits_mib = BATCH * SEQ * VOCAB * 4 / 2**20
    say(f"a small LM: {BATCH * SEQ} tokens a step, vocabulary {VOCAB}, hidden {HIDDEN} (float32 logits "
        f"{logits_mib:.0f} MiB), inner compiler {args.inner}")  # fmt: skip
    say("starting a fresh process that compiles plain torch.compile and measures its peak memory")
    pool = ThreadPoolExecutor(1)
    child = ["--child", "torch.compile", "--inner", args.inner, "--memory-steps", str(args.memory_steps)]
    plain_memory = pool.submit(run_fresh, [__file__, *child])

    torch.manual_seed(0)
    model = SmallLM()
    models = {"tile_pass": model, "torch.compile": copy.deepcopy(model)}
    steps, losses = {}, {}
    with phase("compiling with tile_pass and running its first step (the longest phase)"):
        steps["tile_pass"], backend = compiled_step(model, "tile_pass", args.inner)
        losses["tile_pass"] = steps["tile_pass"]().item()
    report = backend.report()
    print(f"what tile_pass did (tile_pass.explain prints the same):\n{report}\n", flush=True)
    with phase(f"measuring the peak memory of {args.memory_steps} tile_pass steps"):
        peaks = {"tile_pass": memory_peaks(steps["tile_pass"], args.memory_steps)}
    with phase("compiling with plain torch.compile and running its first step"):
        steps["torch.compile"], _ = compiled_step(models["torch.compile"], "torch.compile", args.inner)
        losses["torch.compile"] = steps["torch.compile"]().item()
    with phase("checking both against eager in float64 (the loss and every gradient)"):
        tokens, labels = batch()
        oracle = copy.deepcopy(model).double()
        oracle.zero_grad(set_to_none=True)
        ref = oracle(tokens, labels)
        ref.backward()
        errors = {mode: relative_errors(models[mode], oracle) for mode in MODES}
        del oracle
    with phase("waiting for the torch.compile memory process (nothing may run beside the timed steps)"):
        peaks["torch.compile"] = plain_memory.result()["peak_mib"]
        pool.shutdown()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with phase(f"timing: a warm-up step of each mode, then {rounds} rounds of one step of each"):
        allocator_steady_state()  # glibc's own thresholds, as a long-running process has them
        for mode in MODES:
            steps[mode]()
        for round_index in range(rounds):
            for mode in MODES if round_index % 2 == 0 else reversed(MODES):
                times[mode].append(timed(steps[mode], CPU)[1])

    ratios = [t / p for t, p in zip(times["tile_pass"], times["torch.compile"], strict=True)]
    memory = [t / p for t in peaks["tile_pass"] for p in peaks["torch.compile"]]
    print(f"\none training step, {BATCH * SEQ} tokens, vocabulary {VOCAB} (float32 logits {logits_mib:.0f} "
          f"MiB), inner={args.inner}; medians (min-max)")  # fmt: skip
    rows = [("", "peak MiB", "seconds a step", "loss error", "gradient errors")]
    for mode in MODES:
        peak, seconds, grads = peaks[mode], times[mode], errors[mode]
        loss_error = abs(losses[mode] - ref.item()) / abs(ref.item())
        rows.append((
            mode,
            f"{statistics.median(peak):.0f} ({min(peak):.0f}-{max(peak):.0f})",
            f"{statistics.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})",
            f"{loss_error:.1e}",
            f"{min(grads):.1e}-{max(grads):.1e}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"tile_pass / torch.compile: memory {statistics.median(memory):.2f}x ({min(memory):.2f}-"
          f"{max(memory):.2f}), time {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, "
          f"the ratios of the {rounds} rounds)")  # fmt: skip
    print(f"errors are relative to float64 eager's largest magnitude; gradient errors: the best and worst "
          f"of the {len(errors['tile_pass'])} parameters")  # fmt: skip
    if max(errors["tile_pass"]) > 1e-4 or not report.rewrites:
        sys.exit("tile_pass demo: the rewrite did not happen or gradients disagree")


if __name__ == "__main__":
    main()
