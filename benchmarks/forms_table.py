"""One Markdown table per bench JSON of the loss forms: both timing methods side by side.

    python benchmarks/forms_table.py benchmarks/forms_zen5_fp32_n2048_issue46.json

Per form: plain Inductor's and tile_pass's step in a fresh process each (glibc's default
allocator, median of the timed steps), their ratio, the interleaved ratio (median of the
round-by-round ratios), tile_pass against the form's GEMM floor and against its own CE step
(interleaved), the peaks, and the minor page faults per step of both sides (fresh; the peak
step's in parentheses). The caption names the CPU, the allocator and the load.
"""

from __future__ import annotations

import json
import statistics
import sys


def _paired(a: dict, b: dict) -> float | None:
    """The median round-by-round ratio of two interleaved rows (``None`` where one was not)."""
    if "interleaved_steps_s" not in a or "interleaved_steps_s" not in b:
        return None
    pairs = zip(a["interleaved_steps_s"], b["interleaved_steps_s"], strict=True)
    return statistics.median(x / y for x, y in pairs)


def _g(row: dict | None, key: str, fmt: str = "{:.0f}") -> str:
    return _f(row.get(key) if row else None, fmt)


def _f(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(path: str) -> str:
    data = json.load(open(path))
    rows = [r for r in data["rows"] if "error" not in r]
    machine = data["machine"]
    by = {(r["impl"], r.get("form", "ce"), r["tokens"]): r for r in rows}
    lines = [
        f"*{machine['cpu']} (family/model {machine.get('cpu_family_model', '?')}), {machine['cores']} cores, "
        f"{' '.join(machine.get('vector_isa', machine.get('gemm_isa', [])))}; torch {machine['torch']}; "
        f"allocator {data.get('allocator', {}).get('timing', '?')} for the timing; load "
        f"{_f(data.get('load_before', [None])[0])} before, {_f(data.get('load_after', [None])[0])} after*",
        "",
        "| form, N | Inductor s | tile_pass s | fresh: tile_pass / Inductor "
        "| interleaved: tile_pass / Inductor | tile_pass / floor (int.) | tile_pass / CE (int.) "
        "| peak MiB Inductor → tile_pass | faults/step Inductor, tile_pass (peak step) | err loss, dW |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen = []
    for r in rows:
        key = (r.get("form", "ce"), r["tokens"])
        if r["impl"] != "tile_pass" or key in seen:
            continue
        seen.append(key)
        form, n = key
        ind = by.get(("inductor", form, n))
        floor = by.get(("gemm_floor", form, n)) or by.get(("gemm_floor", "ce", n))
        ce = by.get(("tile_pass", "ce", n))
        fresh = r["median_s"] / ind["median_s"] if ind and ind.get("exact", True) else None
        inter = _paired(r, ind) if ind and ind.get("exact", True) else None
        note = "" if not ind or ind.get("exact", True) else " (Inductor NOT EXACT)"
        lines.append(
            f"| {form}, {n} | {_f(ind and ind['median_s'], '{:.3f}')}{note} | {r['median_s']:.3f} "
            f"| {_f(fresh)} "
            f"| {_f(inter)} | {_f(_paired(r, floor) if floor else None)} "
            f"| {_f(_paired(r, ce) if ce and form != 'ce' else None)} "
            f"| {_f(ind and ind.get('peak_mib'), '{:.0f}')} → {r['peak_mib']:.0f} "
            f"| {_f(ind and ind.get('faults_median'), '{:.0f}')}, {_f(r.get('faults_median'), '{:.0f}')} "
            f"({_g(ind, 'peak_step_faults')}, {_g(r, 'peak_step_faults')}) "
            f"| {_f(r.get('err_loss'), '{:.0e}')}, {_f(r.get('err_dw'), '{:.0e}')} |"
        )
    floors = [r for r in rows if r["impl"] == "gemm_floor"]
    lines.append("")
    lines.append(
        "GEMM floor: "
        + "; ".join(
            f"{r.get('form', 'ce')} {r['median_s']:.3f} s fresh, "
            f"{_f(r.get('interleaved_s'), '{:.3f}')} s interleaved"
            for r in floors
        )
    )
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(table(path))
        print()
