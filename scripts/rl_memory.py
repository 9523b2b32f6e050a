"""Peak memory of the RL frameworks' training steps with and without tile_pass (docs/stacks.md).

Each row is one micro-batch of a step from ``tests/rl_steps.py`` (the frameworks' own loss code
where it installs), at a larger size than the tests' (``--size T,H,V``; two sequences, one
micro-batch), run in a fresh interpreter per implementation: eager, ``torch.compile`` with
``aot_eager``, and tile_pass over ``aot_eager``. The peak is the step's extra resident memory above
its inputs (VmHWM after resetting it, glibc's thresholds pinned; :mod:`tile_pass._measure`), after
one warm-up step that compiles.

    python scripts/rl_memory.py                 # the table
    python scripts/rl_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "verl/padded-vanilla",
    "verl/rmpad-engine-temperature",
    "openrlhf/ppo-k3-entropy",
    "torchtune/ppo",
    "torchtune/dpo",
    "openrlhf/dpo",
    "torchtune/grpo",
    "nemo-rl/clipped-pg",
]
IMPLEMENTATIONS = ["eager", "aot_eager", "tile_pass"]


def _child(key: str, implementation: str) -> dict:
    import torch

    import tile_pass
    from tile_pass import _measure

    sys.path.insert(0, str(ROOT / "tests"))
    import rl_steps

    step = next(s for s in rl_steps.all_steps() if f"{s.framework}/{s.name}" == key)
    torch.manual_seed(0)
    h, w, d = step.data("cpu")
    h.requires_grad_()
    w.requires_grad_()
    backend = None
    if implementation == "eager":
        fn = step.fn
    else:
        if step.framework == "openrlhf" and implementation == "tile_pass":
            from tile_pass.integrations.openrlhf import hand_log_probs_to_tile_pass

            hand_log_probs_to_tile_pass()  # the documented one line
        if step.framework == "nemo-rl":  # its metrics' .item(): the setting the report names
            torch._dynamo.config.capture_scalar_outputs = True
        backend = tile_pass.backend("aot_eager") if implementation == "tile_pass" else "aot_eager"
        fn = torch.compile(step.fn, backend=backend)

    def run():
        h.grad = w.grad = None
        out = fn(h, w, d)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()

    run()  # compiles
    h.grad = w.grad = None
    device = torch.device("cpu")
    base = _measure.reset_peak_memory(device)
    loss = run()
    peak = _measure.peak_memory(device) - base
    rewritten = len(backend.report().rewrites) if implementation == "tile_pass" else None
    logits_mib = h.shape[:-1].numel() * w.shape[0] * 4 / _measure.MiB  # float32 [N, V]
    return {"step": key, "implementation": implementation, "peak_mib": peak / _measure.MiB,
            "logits_mib": logits_mib, "loss": float(loss), "rewritten": rewritten}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1024,256,32000", help="T,H,V (two sequences of T tokens)")
    parser.add_argument("--steps", nargs="*", default=STEPS)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    from tile_pass import _measure

    env = {"TILE_PASS_RL_STEP_SIZE": args.size, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    rows = []
    for key in args.steps:
        for implementation in IMPLEMENTATIONS:
            try:
                argv = [__file__, "--child", key, implementation]
                rows.append(_measure.run_fresh(argv, env=env, timeout=1200))
            except (RuntimeError, subprocess.TimeoutExpired) as failed:  # a row says so; the others run
                rows.append({"step": key, "implementation": implementation, "failed": str(failed)[-300:]})
    print(f"T,H,V = {args.size}; peak MiB above the step's inputs; ratio = tile_pass / aot_eager")
    header = ("step", "logits MiB", "eager", "aot_eager", "tile_pass", "ratio")
    print("{:28} {:>10} {:>7} {:>10} {:>10} {:>6}  rewritten".format(*header))
    for key in args.steps:
        by = {r["implementation"]: r for r in rows if r["step"] == key}
        if any("failed" in r for r in by.values()):
            failed = "; ".join(f"{i}: {r['failed']}" for i, r in by.items() if "failed" in r)
            print(f"{key:28} failed: {failed}")
            continue
        ratio = by["tile_pass"]["peak_mib"] / by["aot_eager"]["peak_mib"]
        print(f"{key:28} {by['eager']['logits_mib']:10.0f} {by['eager']['peak_mib']:7.0f} "
              f"{by['aot_eager']['peak_mib']:10.0f} {by['tile_pass']['peak_mib']:10.0f} {ratio:6.2f}  "
              f"{by['tile_pass']['rewritten']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": _measure_machine(), "size": args.size, "steps": rows}, out, indent=1)


def _measure_machine() -> dict:
    from tile_pass.bench import machine_info

    return machine_info()


if __name__ == "__main__":
    main()
