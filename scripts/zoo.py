"""Run the zoo: every causal-LM class of the installed transformers, one training step each,
compiled with tile_pass and eagerly (tests/zoo.py classifies them); print a table and write
docs/models.md.

    python scripts/zoo.py                       # every family, writes docs/models.md
    python scripts/zoo.py --families llama,gpt2 --no-write
    python scripts/zoo.py --json /tmp/zoo.json  # the raw results too

The families run one after another in a worker process; a worker that dies (a segfault, an
abort) is replaced, and the family it was on is recorded as such.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
COMMAND = "python scripts/zoo.py"


def worker(families: list[str], out_path: str, time_limit: float) -> None:
    """Run ``families`` in this process, appending a 'start' line then the result per family."""
    import torch

    torch.set_num_threads(1)
    import zoo

    names = dict(zoo.families())
    with open(out_path, "a", encoding="utf-8") as out:
        for model_type in families:
            out.write(json.dumps({"start": model_type}) + "\n")
            out.flush()
            result = zoo.run_family(model_type, names[model_type], time_limit=time_limit)
            out.write(json.dumps(result.to_dict()) + "\n")
            out.flush()


def run_all(families: list[str], time_limit: float, verbose: bool = True) -> list[dict]:
    """Every family, in worker processes replaced when one dies; the results in order."""
    import zoo

    names = dict(zoo.families())
    results: dict[str, dict] = {}
    todo = list(families)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.jsonl")
        while todo:
            open(out_path, "w").close()
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                ",".join(todo),
                "--out",
                out_path,
                "--time-limit",
                str(time_limit),
            ]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            seen = 0
            current, started = None, time.monotonic()
            while True:
                done = proc.poll() is not None
                with open(out_path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
                for line in lines[seen:]:
                    record = json.loads(line)
                    if "start" in record:
                        current, started = record["start"], time.monotonic()
                        continue
                    results[record["model_type"]] = record
                    todo.remove(record["model_type"])
                    current = None
                    if verbose:
                        _print_row(record, len(results), len(families))
                seen = len(lines)
                if done:
                    break
                if current is not None and time.monotonic() - started > time_limit + 120:
                    proc.kill()  # the in-process limit did not fire (stuck in C code)
                    proc.wait()
                    break
                time.sleep(0.5)
            stderr = proc.stderr.read() if proc.stderr else ""
            if current is not None and current in todo:  # the worker died on this family
                tail = " ".join(stderr.strip().splitlines()[-2:])[-300:]
                record = zoo.Result(
                    current,
                    names[current],
                    outcome=zoo.FAILURE,
                    reason=f"the worker process died (exit {proc.returncode}) {tail}".strip(),
                    seconds=round(time.monotonic() - started, 2),
                ).to_dict()
                results[current] = record
                todo.remove(current)
                if verbose:
                    _print_row(record, len(results), len(families))
            elif proc.returncode and todo:
                raise RuntimeError(f"the zoo worker failed before a family started:\n{stderr[-2000:]}")
    return [results[m] for m in families if m in results]


def _print_row(r: dict, i: int, n: int) -> None:
    reason = r["reason"] if len(r["reason"]) <= 150 else r["reason"][:147] + "..."
    print(
        f"[{i:3d}/{n}] {r['class_name']:<42} {r['model_type']:<26} {r['outcome']:<24} {r['seconds']:7.1f}s  "
        f"{reason}",
        flush=True,
    )


def _cell(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown(results: list[dict], seconds: float) -> str:
    import torch
    import transformers
    import zoo

    counts = collections.Counter(r["outcome"] for r in results)
    reasons = collections.Counter(r["reason"] for r in results if r["outcome"] == zoo.NOT_REWRITTEN)
    rewritten = [r for r in results if r["outcome"] == zoo.REWRITTEN]
    worst = max(rewritten, key=lambda r: r["max_error"], default=None)
    floored = [r for r in rewritten if (r.get("max_error_own_scale") or 0.0) > 1.0]
    special = sorted(set(zoo.OVERRIDES) | set(zoo.POST_BUILD))
    lines = [
        "# The zoo: every causal-LM class of transformers, one training step",
        "",
        f"Produced by `{COMMAND}` on {datetime.date.today().isoformat()} with transformers "
        f"{transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()} "
        f"({platform.machine()}, CPU), in {seconds / 60:.0f} minutes; `python -m pytest tests/test_zoo.py` "
        "runs a sample of them (`-m slow`: all). Every entry of transformers' "
        f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)} model types -> their class) is built from "
        "its config class's defaults shrunk to a tiny model (`tests/zoo.py`: vocabulary 512, hidden 64, "
        "2 layers, 4 heads, 2 key/value heads, 4 experts with 2 per token, windows of 8; per-layer lists "
        "cut to the layers kept; dropout 0), with random weights from seed 0 (nothing downloaded). One "
        "training step (`model.train()`, `input_ids` `[2, 16]`, `labels` the ids with 7 of 32 set to "
        "-100) runs eagerly and, from the same initial weights (a deep copy), compiled with "
        '`tile_pass.compile(model, tile_pass.backend("aot_eager", strict=True))` '
        "(`TILE_PASS_STRICT=1`: internal errors of the pass raise).",
        "",
        "Each model is used as transformers builds it. A class whose `loss_type` is unset (the "
        "GPT-2-style `*LMHeadModel` classes: GPT-2, GPT-SW3, OpenAI-GPT, CTRL, BERT, BERT-generation) "
        "logs a once-only advisory from its `loss_function` property, between the head and the loss; "
        "Dynamo ends the graph at any logger call, and `tile_pass.compile` has it trace past "
        "transformers' once-only ones (`warning_once`, `info_once`: "
        "`torch._dynamo.config.ignore_logging_functions`, set only while the compiled model runs), "
        'so head and loss stay in one graph (`torch.compile(model, backend="tile_pass")` alone '
        "cannot set it; its report names the setting). "
        f"{len(special)} families get more than the shrink, because their default config does not build "
        "or run as it stands or fixes the input shape (each is explained in `tests/zoo.py`'s `OVERRIDES` / "
        f"`POST_BUILD`): {', '.join(special)}.",
        "",
        "Outcomes:",
        "",
        f"* **{zoo.REWRITTEN}** ({counts[zoo.REWRITTEN]}): the LM head and its loss were rewritten, and the "
        "loss, the returned logits and every parameter gradient match the eager step's: each element "
        f"within {zoo.RTOL} of itself plus {zoo.RTOL} of the tensor's largest magnitude; for a gradient, "
        f"of the larger of that and {zoo.GRAD_FLOOR:g} of the model's largest gradient"
        + (
            f" (worst: {worst['max_error']:.2g} of the tolerance, {worst['model_type']})"
            if worst is not None
            else ""
        )
        + ";",
        f"* **{zoo.NOT_REWRITTEN}** ({counts[zoo.NOT_REWRITTEN]}): left to the inner compiler (the numbers "
        "match eager's), with tile_pass's reason, or, where it saw no candidate, what the graphs hold;",
        f'* **{zoo.PLAIN_FAILS}** ({counts[zoo.PLAIN_FAILS]}): plain `torch.compile(backend="aot_eager")` '
        "fails (or differs from eager) too: not tile_pass's doing;",
        f"* **{zoo.BUILD_FAILS}** ({counts[zoo.BUILD_FAILS]}): the model cannot be built from the shrunk "
        "config, or its eager step fails;",
        f"* **{zoo.FAILURE}** ({counts[zoo.FAILURE]}): tile_pass's fault: a crash that plain aot_eager does "
        "not have, numbers off where plain aot_eager's are not, or an LM head and its cross entropy in "
        "one graph left without a reason.",
        "",
    ]
    if floored:
        lines += [
            f"The floor matters for {len(floored)} rewritten families, each for one gradient that is zero "
            "in exact arithmetic or nearly so (mostly the key projection's bias: softmax attention does "
            "not change when a whole row of scores moves by the same amount). Its float32 value is rounding "
            "noise that changes with the order of any sum: plain aot_eager reproduces eager's noise bit for "
            "bit, the tiled loss sums in another order. Against that tensor's own largest magnitude (the "
            "noise) the error is, in units of the tolerance, as below; the float64 eager step says what "
            "the gradient really is and how far each float32 step is from it:",
            "",
            "| model type | tensor | error against its own magnitude | float64 eager |",
            "|---|---|---:|---|",
        ]
        lines += [
            f"| {r['model_type']} | {r['max_error_own_scale_in']} | {r['max_error_own_scale']:.3g} | "
            f"{_cell(r.get('float64_check', ''))} |"
            for r in floored
        ]
        lines.append("")
    if reasons:
        lines += ["Why not rewritten:", "", "| families | reason |", "|---:|---|"]
        lines += [f"| {n} | {_cell(reason, 2000)} |" for reason, n in reasons.most_common()]
        lines.append("")
    lines += [
        "| model type | class | outcome | what was rewritten / why not / exception | max error | s |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in results:
        outcome = f"**{r['outcome']}**" if r["outcome"] == zoo.FAILURE else r["outcome"]
        error = f"{r['max_error']:.2g}" if r.get("max_error") is not None else ""
        lines.append(
            f"| {r['model_type']} | {r['class_name']} | {outcome} | {_cell(r['reason'])} | {error} | "
            f"{r['seconds']:.1f} |"
        )
    lines += [
        "",
        "max error: the worst element of the loss, the logits and the gradients against the eager step, "
        "in units of the tolerance (at most 1 passes).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--out-md", default=os.path.join(ROOT, "docs", "models.md"))
    parser.add_argument("--no-write", action="store_true", help="do not write docs/models.md")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker.split(","), args.out, args.time_limit)
        return 0
    import zoo

    families = args.families.split(",") if args.families else [m for m, _ in zoo.families()]
    start = time.monotonic()
    results = run_all(families, args.time_limit)
    seconds = time.monotonic() - start
    counts = collections.Counter(r["outcome"] for r in results)
    print("\n" + ", ".join(f"{o}: {counts[o]}" for o in zoo.OUTCOMES) + f"  ({seconds / 60:.1f} min)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    if not args.no_write:
        with open(args.out_md, "w", encoding="utf-8") as f:
            f.write(markdown(results, seconds))
        print(f"wrote {os.path.relpath(args.out_md)}")
    return 1 if counts[zoo.FAILURE] else 0


if __name__ == "__main__":
    sys.exit(main())
