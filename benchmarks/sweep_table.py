"""The side-by-side table of a ``python -m tile_pass.bench`` sweep of tile_pass against Inductor.

    python benchmarks/sweep_table.py benchmarks/bf16_sweep_v32000.json benchmarks/bf16_sweep_v128256.json

One line per (vocabulary, form, dtype, tokens): the GEMM floor, both step times and their ratio, both
peaks (pinned allocator, "live bytes", and glibc's own thresholds) and their ratios, and the
tile plan tile_pass ran. Every ratio is between rows of the same run (same file); a case that
several files hold is taken from the last of them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _rows(paths: list[str]) -> tuple[dict[tuple, dict[str, dict[str, Any]]], dict[tuple, float]]:
    """The rows by (V, form, dtype, N, H) and implementation, and the GEMM floor by shape (the
    same GEMMs for every loss form)."""
    by_case: dict[tuple, dict[str, dict[str, Any]]] = {}
    floors: dict[tuple, float] = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if "error" in row or row.get("swept"):
                    continue
                shape = (row["vocab"], row["tokens"], row["hidden"], row["dtype"])
                if row["impl"] == "gemm_floor":
                    floors[shape] = row["median_s"]
                case = (row["vocab"], row["form"], row["dtype"], row["tokens"], row["hidden"])
                by_case.setdefault(case, {})[row["impl"]] = row
    return by_case, floors


def table(paths: list[str]) -> str:
    """The Markdown table of the rows in ``paths`` that have both an Inductor and a tile_pass run."""
    lines = [
        "| V | form | dtype | N | GEMM floor s | inductor s | tile_pass s | time/ind | inductor peak"
        " | tile_pass peak | peak/ind | inductor glibc | tile_pass glibc | glibc/ind | tiles |",
        "|" + "---|" * 15,
    ]
    worst = 0.0
    by_case, floors = _rows(paths)
    for case, impls in sorted(by_case.items()):  # by V, form, dtype, N
        ind, tp = impls.get("inductor"), impls.get("tile_pass")
        if ind is None or tp is None:
            continue
        vocab, form, dtype, tokens, hidden = case
        floor = floors.get((vocab, tokens, hidden, dtype))
        ratio = tp["median_s"] / ind["median_s"]
        plan = tp.get("note", "").removeprefix("tile=")
        worst = max(worst, ratio)
        lines.append(
            f"| {vocab} | {form} | {dtype} | {tokens} | {'-' if floor is None else f'{floor:.2f}'} "
            f"| {ind['median_s']:.2f} | {tp['median_s']:.2f} | {ratio:.2f} "
            f"| {ind['peak_mib']:.0f} | {tp['peak_mib']:.0f} | **{tp['peak_mib'] / ind['peak_mib']:.2f}** "
            f"| {ind['peak_glibc_mib']:.0f} | {tp['peak_glibc_mib']:.0f} "
            f"| {tp['peak_glibc_mib'] / ind['peak_glibc_mib']:.2f} | {plan} |"
        )
    lines.append(f"\nslowest time/ind: {worst:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="python -m tile_pass.bench --json files")
    print(table(parser.parse_args().json))


if __name__ == "__main__":
    main()
