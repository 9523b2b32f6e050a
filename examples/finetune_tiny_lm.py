"""Fine-tune a tiny Hugging Face causal LM on CPU: plain torch.compile vs tile_pass, side by side.

    python examples/finetune_tiny_lm.py      # aot_eager, V=32000, 2048 tokens: about a minute
    python examples/finetune_tiny_lm.py --inner inductor --vocab 65536 --tokens 4096   # minutes

The model is a randomly initialised Llama built from a tiny config (no download). Each
configuration runs in a fresh process and reports its losses and the peak memory of one
training step above the model, optimizer state and batch. tile_pass is shown twice: with
the logits returned (the default, exact: the model-dtype logits are kept because the model
returns them) and with ``drop_logits=True`` (the opt-in for training loops that ignore them).
Each process says what it is doing as it goes. The step times come from processes run one
after the other (a shared machine's load moves them by 10-20%); ``examples/demo.py`` times
steps interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import tile_pass
from tile_pass._measure import FRESH_PROCESS_ENV, allocator_steady_state, peak_memory, reset_peak_memory

MODES = ("torch.compile", "tile_pass", "tile_pass drop_logits")


def build_model(vocab: int):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batches(vocab: int, tokens: int, steps: int):
    g = torch.Generator().manual_seed(0)
    seq = 1024 if tokens >= 1024 else tokens
    for _ in range(steps):
        ids = torch.randint(0, vocab, (tokens // seq, seq), generator=g)
        labels = ids.clone()
        labels[0, : seq // 4] = -100  # an unsupervised prompt
        yield ids, labels


def progress(text: str) -> None:
    """A line on stderr, now: the parent passes it through while it reads the JSON on stdout."""
    print(text, file=sys.stderr, flush=True)


def run_fresh_with_progress(argv: list[str]) -> dict:
    """``tile_pass._measure.run_fresh``, with the child's stderr (its progress) shown as it comes."""
    env = dict(os.environ, **FRESH_PROCESS_ENV)
    proc = subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{argv} failed (its error is above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(mode: str, args) -> None:
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(args.vocab).train()
    if mode == "torch.compile":
        backend = args.inner
    else:
        backend = tile_pass.backend(args.inner, drop_logits=mode.endswith("drop_logits"))
    step_fn = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peak, seconds = [], 0, []
    progress(f"    model built ({time.perf_counter() - start:.0f} s); step 1 compiles ...")
    for i, (ids, labels) in enumerate(batches(args.vocab, args.tokens, args.steps + 1)):
        base = reset_peak_memory(torch.device("cpu")) if i == 1 else 0
        t0 = time.perf_counter()
        out = step_fn(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        if i == 1:  # step 0 compiled and created the optimizer state
            peak = peak_memory(torch.device("cpu")) - base
            allocator_steady_state()  # later steps are timed as a long-running process runs them
        losses.append(out.loss.item())
        del out
        what = "compiled" if i == 0 else "peak memory measured" if i == 1 else "timed"
        progress(f"    step {i + 1}/{args.steps + 1}: {seconds[-1]:.2f} s ({what})")
    rewrites = len(backend.report().rewrites) if isinstance(backend, tile_pass.Backend) else 0
    timed = seconds[2:] or seconds[1:]  # the steps after the memory step
    step_s = sorted(timed)[len(timed) // 2]
    result = {"losses": losses, "peak_mib": peak / 2**20, "first_s": seconds[0], "step_s": step_s}
    print(json.dumps({**result, "rewrites": rewrites}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="steps after the compiling one")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)

    results = {}
    for mode in MODES:
        argv = [__file__, "--child", mode, "--inner", args.inner, "--vocab", str(args.vocab),
                "--tokens", str(args.tokens), "--steps", str(args.steps)]  # fmt: skip
        print(f"{mode}: a fresh process builds the model, compiles it (inner {args.inner}) and trains "
              f"{args.steps + 1} steps ...", flush=True)  # fmt: skip
        start = time.perf_counter()
        results[mode] = run_fresh_with_progress(argv)
        print(f"    done in {time.perf_counter() - start:.0f} s", flush=True)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tiny Llama, vocab {args.vocab}, {args.tokens} tokens/step (fp32 logits {logits_mib:.0f} MiB), "
          f"inner={args.inner}, AdamW, {args.steps} measured steps")  # fmt: skip
    print(f"{'':24}{'peak MiB':>10}{'step s':>9}{'first s':>9}   losses")
    base = results["torch.compile"]
    for mode, r in results.items():
        losses = " ".join(f"{x:.5f}" for x in r["losses"])
        print(f"{mode:<24}{r['peak_mib']:>10.0f}{r['step_s']:>9.2f}{r['first_s']:>9.1f}   {losses}")
    for mode in MODES[1:]:
        r = results[mode]
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
        memory, time_ratio = r["peak_mib"] / base["peak_mib"], r["step_s"] / base["step_s"]
        print(f"{mode}: memory {memory:.2f}x, time {time_ratio:.2f}x of torch.compile; "
              f"max loss difference {loss_diff:.2e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if any(results[m]["rewrites"] < 1 for m in MODES[1:]):
        sys.exit("tile_pass did not rewrite the loss")


if __name__ == "__main__":
    main()
