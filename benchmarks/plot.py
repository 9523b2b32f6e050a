"""Plot a ``python -m tile_pass.bench --json`` result: peak memory and step time against tokens.

    pip install -e .[bench]
    python benchmarks/plot.py benchmarks/quick.json [more.json ...] [--out benchmarks]

One line per implementation for each (hidden, vocab, dtype) group, so different shapes are
never joined into one misleading curve. Saves ``memory_vs_tokens.png`` and
``time_vs_tokens.png`` (with the GEMM floor as a dashed line) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

STYLE = {
    "eager": ("tab:gray", "o"),
    "inductor": ("tab:blue", "s"),
    "autochunker": ("tab:purple", "v"),
    "torch_chunked": ("tab:orange", "D"),
    "cce": ("tab:brown", "P"),
    "cce_kernel": ("tab:brown", "X"),
    "liger": ("tab:pink", "*"),
    "tile_pass": ("tab:green", "^"),
    "gemm_floor": ("black", "x"),
}


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    """Rows without errors from every JSON file; tile sweeps other than the default are dropped."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [r for r in json.load(f).get("rows", []) if "error" not in r and "median_s" in r]
    return [r for r in rows if not r.get("swept")]


def _groups(rows: list[dict[str, Any]]) -> dict[tuple, dict[tuple, list[dict[str, Any]]]]:
    """Rows by (H, V, dtype), then by (implementation, loss form): one line each."""
    groups: dict[tuple, dict[tuple, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        form = "ce" if row["impl"] == "gemm_floor" else row.get("form", "ce")
        groups[(row["hidden"], row["vocab"], row["dtype"])][(row["impl"], form)].append(row)
    return groups


def _label(impl: str, form: str) -> str:
    if impl == "gemm_floor":
        return "GEMM floor"
    return impl if form == "ce" else f"{impl} ({form})"


def plot(rows: list[dict[str, Any]], key: str, ylabel: str, path: Path, log_y: bool = False) -> None:
    """One subplot per (H, V, dtype); one line per implementation."""
    groups = _groups(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, ((hidden, vocab, dtype), impls) in zip(axes[0], sorted(groups.items()), strict=True):
        for (impl, form), points in sorted(impls.items()):
            if impl == "gemm_floor" and key != "median_s":
                continue
            color, marker = STYLE.get(impl, (None, "."))
            series = [(key, "--" if impl == "gemm_floor" else ("-" if form == "ce" else "-."), "")]
            if key == "peak_mib":  # the same step under glibc's own allocation thresholds
                series.append(("peak_glibc_mib", ":", ", glibc"))
            for field, style, suffix in series:
                shown = sorted((p for p in points if p.get(field) is not None), key=lambda p: p["tokens"])
                if not shown:
                    continue
                ax.plot(
                    [p["tokens"] for p in shown],
                    [p[field] for p in shown],
                    label=_label(impl, form) + suffix,
                    color=color,
                    marker=marker,
                    linestyle=style,
                )
        if key == "peak_mib":  # what the logits alone would take
            tokens = sorted({p["tokens"] for pts in impls.values() for p in pts})
            sizes = {p["tokens"]: p["logits_mib"] for pts in impls.values() for p in pts}
            logits = [sizes[n] for n in tokens]
            ax.plot(tokens, logits, color="lightgray", linestyle=":", marker="_", label="logits size")
        ax.set_title(f"H={hidden}, V={vocab}, {dtype}")
        ax.set_xlabel("tokens N")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="result files of python -m tile_pass.bench --json")
    parser.add_argument("--out", default=str(Path(__file__).parent), help="folder for the PNGs")
    parser.add_argument("--prefix", default="", help="prefix of the PNG names (e.g. bf16_)")
    args = parser.parse_args()
    rows = load_rows(args.json)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, "peak_mib", "peak memory above inputs (MiB)", out / f"{args.prefix}memory_vs_tokens.png")
    plot(rows, "median_s", "forward+backward step (s)", out / f"{args.prefix}time_vs_tokens.png", log_y=True)


if __name__ == "__main__":
    main()
