"""The benchmark machinery on a tiny shape: every row measured, exact, and tabulated."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tile_pass import bench

SHAPE = (256, 64, 1000, "float32")
IMPLS = ("eager", "inductor", "tile_pass")
MEASURED = ("median_s", "peak_mib", "compile_s", "recompiles", "err_loss", "err_dh", "err_dw")


@pytest.fixture(scope="module")
def rows():
    return bench.run_benchmark([SHAPE], IMPLS, repeats=1, warm_cache=True, timeout=300)


def test_one_row_per_implementation_plus_the_gemm_floor(rows):
    assert [r["impl"] for r in rows] == [bench.FLOOR, *IMPLS]
    for row in rows:
        assert "error" not in row, row
        assert (row["tokens"], row["hidden"], row["vocab"], row["dtype"]) == SHAPE
        assert row["median_s"] > 0 and row["time_x_floor"] > 0
    for row in rows[1:]:
        missing = [k for k in MEASURED if row.get(k) is None]
        assert not missing, (row["impl"], missing)
        assert row["recompiles"] == 0 and row["steady_new_graphs"] == 0
        assert row["peak_mib"] >= 0
        assert len(row["steps_s"]) == 1 and row["steps_s"] == sorted(row["steps_s"])
        assert row["median_s"] == pytest.approx(statistics.median(row["steps_s"]), abs=1e-4)


def test_steps_are_timed_under_the_users_allocator_and_the_peak_under_a_pinned_one(rows, monkeypatch):
    """The timing child inherits this process's allocator (no 64 KiB mmap threshold forced on it:
    that setting maps every block afresh, page faults a training process does not pay), records
    each step's minor page faults, and only its peak step runs with the threshold pinned."""
    inherited = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    for row in rows:
        assert row["allocator"]["timing"] == (inherited or "glibc defaults"), row["impl"]
        assert row["faults_median"] >= 0
    for row in rows[1:]:
        assert len(row["faults_per_step"]) == len(row["steps_s"]) == row["repeats"]
        assert row["allocator"]["peak"] == {"M_MMAP_THRESHOLD": 65536, "M_TRIM_THRESHOLD": 0}
    eager = next(r for r in rows if r["impl"] == "eager")
    # pinned, each block above 64 KiB is a fresh mapping: eager's logits alone fault every page in
    assert eager["peak_step_faults"] >= eager["logits_mib"] * 2**20 / 4096


def test_every_table_names_the_cpu_and_the_allocator_settings(rows):
    machine = bench.machine_info()
    table = bench.format_table(rows, machine=machine)
    caption = table.splitlines()[0]
    assert caption.startswith(f"CPU: {machine['cpu']}") and f"{machine['cores']} cores" in caption
    assert "glibc defaults" in caption or "MALLOC_" in caption
    assert "M_MMAP_THRESHOLD=65536" in caption and "faults/step" in table.splitlines()[1]
    markdown = bench.format_table(rows, markdown=True, machine=machine)
    assert markdown.startswith("*CPU: ") and "| faults/step |" in markdown
    if "vector_isa" in machine:
        assert " ".join(machine["vector_isa"]) in caption
        assert set(machine["gemm_isa"]) <= set(machine["vector_isa"]) | {"amx_tile", "amx_bf16"}


def test_gemm_floor_sums_the_fastest_library_per_gemm(rows):
    floor = rows[0]
    per_library = floor["gemm_s"]
    assert set(per_library) >= {"aten"} and all(len(times) == 3 for times in per_library.values())
    if bench._floor_gemms(torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1)).get("onednn"):
        assert "onednn" in per_library  # tile_pass's float32 CPU tiles call it
    fastest = sum(min(times) for times in zip(*per_library.values(), strict=True))
    assert floor["median_s"] == pytest.approx(fastest, rel=1e-3, abs=1e-3)


def test_floor_gemms_compute_the_same_products():
    gen = torch.Generator().manual_seed(0)
    h, w, g = (torch.randn(shape, generator=gen) for shape in ((6, 4), (5, 4), (6, 5)))
    libraries = bench._floor_gemms(h, w, g)
    for gemms in libraries.values():
        for got, want in zip((gemm() for gemm in gemms), (h @ w.T, g @ w, g.T @ h), strict=True):
            torch.testing.assert_close(got, want)


def test_ratios_are_against_inductor_of_the_same_shape(rows):
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["inductor"]["time_x_inductor"] == 1.0
    tiled = by_impl["tile_pass"]
    assert tiled["time_x_inductor"] == pytest.approx(tiled["median_s"] / by_impl["inductor"]["median_s"])
    assert tiled["compile_x_inductor"] == pytest.approx(tiled["compile_s"] / by_impl["inductor"]["compile_s"])


def test_tile_pass_rewrote_and_matches_float64(rows):
    tiled = next(r for r in rows if r["impl"] == "tile_pass")
    assert tiled["fired"] and tiled["tile_tokens"] >= 16, tiled["note"]
    for key in ("err_loss", "err_dh", "err_dw"):
        assert tiled[key] < 2e-5, (key, tiled[key])
    eager = next(r for r in rows if r["impl"] == "eager")
    assert tiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)


def test_table_has_every_row_and_column(rows):
    table = bench.format_table(rows).splitlines()
    assert len(table) == 1 + len(rows)
    for _, title, _ in bench.COLUMNS:
        assert title in table[0]
    assert table[-1].startswith("tile_pass") and "tile=" in table[-1]
    markdown = bench.format_table(rows, markdown=True).splitlines()
    assert len(markdown) == 2 + len(rows) and markdown[0].startswith("| impl")
    json.dumps(rows)  # what --json writes


def test_error_metric_catches_a_wrong_gradient():
    """The exactness columns would flag an implementation that gets the gradient wrong."""
    torch.manual_seed(0)
    h, w = torch.randn(64, 8, requires_grad=True), torch.randn(100, 8, requires_grad=True)
    y = torch.randint(0, 100, (64,))
    y[::5] = bench.IGNORE_INDEX
    F.cross_entropy(F.linear(h, w), y).backward()
    loss, ref_h, ref_w = bench.float64_reference(h, w, y, chunk_bytes=8 * 100 * 2 * 10)  # 10-row chunks
    assert bench.relative_error(h.grad, ref_h) < 1e-5
    assert bench.relative_error(w.grad, ref_w) < 1e-5
    assert bench.relative_error(h.grad * 1.01, ref_h) > 5e-3
    assert bench.relative_error(w.grad / 32, ref_w) > 0.5  # a mean over 32 tiles of tile means


def test_failed_child_becomes_an_error_row():
    row = bench.measure_fresh(bench.BenchConfig(impl="no_such_impl", tokens=16, hidden=4, vocab=8))
    assert "unknown implementation" in row["error"]
    assert "ERROR" in bench.format_table([row])


def test_machine_info_names_the_cpus_gemm_instruction_sets():
    """Same model name, different bf16 GEMMs: the sweeps record the family/model and the flags."""
    info = bench.machine_info()
    assert info["cpu"] and info["cores"] >= 1 and info["torch"] == torch.__version__
    if shutil.which("lscpu") and "Flags" in subprocess.run(["lscpu"], capture_output=True, text=True).stdout:
        assert "/" in info["cpu_family_model"]
        assert set(info["gemm_isa"]) <= set(bench._GEMM_FLAGS)
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split() for line in cpuinfo if line.startswith("flags")), None)
        if flags is not None:  # x86 (arm64 names them "Features")
            assert info["gemm_isa"] == [flag for flag in bench._GEMM_FLAGS if flag in flags]


def test_dynamic_lengths_avoid_the_hidden_and_vocab_sizes():
    lengths = bench.dynamic_lengths(2048, hidden=512, vocab=32000)
    assert len(lengths) == 8 and lengths[-1] == 2048 and 512 not in lengths
    assert 513 in lengths  # 25% of 2048, moved off H
    assert 1000 not in bench.dynamic_lengths(4000, hidden=64, vocab=1000)


def test_memory_guard_bounds_every_recorded_peak():
    """The child-skipping estimate must stay above what was measured, or it guards nothing."""
    from pathlib import Path

    fields = {f.name for f in dataclasses.fields(bench.BenchConfig)}
    checked = 0
    for path in sorted((Path(__file__).parent.parent / "benchmarks").glob("*.json")):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("peak_mib") is None or row.get("device", "cpu") != "cpu":
                continue
            cfg = bench.BenchConfig(**{k: v for k, v in row.items() if k in fields})
            assert bench.estimated_peak_bytes(cfg) > row["peak_mib"] * 2**20, (path.name, row["impl"])
            checked += 1
    assert checked >= 20


def test_loss_forms_are_measured_beside_the_plain_cross_entropy():
    rows = bench.run_benchmark(
        [SHAPE], ("tile_pass", "torch_chunked"), repeats=1, warm_cache=True, timeout=300, floor=False,
        forms=("ce", "grpo"),
    )  # fmt: skip
    by_form = {(r["impl"], r["form"]): r for r in rows}
    assert ("torch_chunked", "grpo") not in by_form  # it computes cross entropy only
    grpo = by_form[("tile_pass", "grpo")]
    assert "error" not in grpo, grpo
    assert grpo["fired"] and grpo["err_loss"] < 1e-4 and grpo["err_dw"] < 1e-4, grpo
    assert grpo["time_x_ce"] == pytest.approx(grpo["median_s"] / by_form[("tile_pass", "ce")]["median_s"])
    assert "grpo" in bench.format_table(rows)


def test_interleaved_rounds_time_every_row_of_a_shape_and_the_ratios_use_them():
    rows = bench.run_benchmark(
        [SHAPE], ("eager",), repeats=1, warm_cache=True, timeout=300, floor=False, check=False,
        forms=("ce", "ce_zloss"), interleave=3,
    )  # fmt: skip
    for row in rows:
        assert "error" not in row and "interleaved_error" not in row, row
        assert len(row["interleaved_steps_s"]) == len(row["interleaved_faults"]) == 3
        assert row["interleaved_s"] == pytest.approx(statistics.median(row["interleaved_steps_s"]), abs=1e-4)
    ce, z_loss = rows
    rounds = zip(z_loss["interleaved_steps_s"], ce["interleaved_steps_s"], strict=True)
    assert z_loss["time_x_ce"] == pytest.approx(statistics.median(z / c for z, c in rounds))
    assert "interleaved s" in bench.format_table(rows)


# ------------------------------------------------------------------ the dpo and distill forms


def test_dpo_and_distill_rows_are_rewritten_exact_and_against_their_own_floor():
    """Each form's chunked and tile_pass rows, its GEMM floor (the teacher's forward in distill's),
    the float64 check of every gradient (the dpo bias's too) and the report's reduction line."""
    rows = bench.run_benchmark(
        [SHAPE], ("chunked", "tile_pass", "torch_chunked"), repeats=1, warm_cache=True, timeout=300,
        forms=("dpo", "distill"), inner="aot_eager",
    )  # fmt: skip
    assert [(r["impl"], r["form"]) for r in rows] == [
        (bench.FLOOR, "dpo"), (bench.FLOOR, "distill"), ("chunked", "dpo"), ("tile_pass", "dpo"),
        ("chunked", "distill"), ("tile_pass", "distill"),
    ]  # fmt: skip
    by = {(r["impl"], r["form"]): r for r in rows}
    assert len(by[(bench.FLOOR, "dpo")]["gemms"]) == 3
    assert by[(bench.FLOOR, "distill")]["gemms"][-1] == "teacher h @ W.T"
    for row in rows[2:]:
        assert "error" not in row, row
        assert row["exact"] is True and row["err_dh"] < 1e-4 and row["err_dw"] < 1e-4, row
        floor = by[(bench.FLOOR, row["form"])]
        assert row["time_x_floor"] == pytest.approx(row["median_s"] / floor["median_s"])
    assert by[("chunked", "dpo")]["err_dextra"] < 1e-4 and by[("tile_pass", "dpo")]["err_dextra"] < 1e-4
    assert "err_dextra" not in by[("tile_pass", "distill")]  # the teacher is frozen
    for form in ("dpo", "distill"):
        tiled = by[("tile_pass", form)]
        assert tiled["fired"] and not tiled["skipped"], tiled["report"]
        assert tiled["reduction"] and f"reduction={tiled['reduction']}" in tiled["note"]
    table = bench.format_table(rows)
    assert all(name in table for name in ("dpo", "distill", "chunked", "teacher h @ W.T", "err db"))


def test_forms_written_once_chunk_to_the_same_loss_and_the_reference_to_the_whole_batch():
    """The chunked rows (several chunks here) and the chunked float64 check against the form on
    the whole batch (a chunk weighted by its own counts instead of the batch's would differ)."""
    from tile_pass import _bench_forms

    for form in ("dpo", "distill"):
        cfg = bench.BenchConfig(tokens=512, hidden=16, vocab=200, form=form)
        h, w, y = bench._make_inputs(cfg)
        extra = bench._form_inputs(form, h, w, y)
        assert len(list(_bench_forms.chunks(form, h, w, y, *extra))) >= 2
        leaves = [h.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
        extra64 = [t.detach().double().requires_grad_(t.requires_grad) for t in extra]
        leaves += [t for t in extra64 if t.requires_grad]
        whole = _bench_forms.FORMS[form](leaves[0], leaves[1], y, *extra64)
        whole_grads = torch.autograd.grad(whole, leaves)
        ref_loss, ref_grads = _bench_forms.float64_reference(form, h, w, y, extra, chunk_tokens=64)
        assert len(ref_grads) == (3 if form == "dpo" else 2)
        torch.testing.assert_close(ref_loss, whole.detach(), rtol=1e-12, atol=0)
        for got, want in zip(ref_grads, whole_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        step = bench._training_step(_bench_forms.chunked(form), h, w, y, extra)
        loss = step()
        assert abs(float(loss) - float(whole)) / abs(float(whole)) < 1e-5
        grads = [h.grad, w.grad, *(t.grad for t in extra if t.requires_grad)]
        for got, want in zip(grads, whole_grads, strict=True):
            assert bench.relative_error(got, want) < 1e-4


def test_a_row_that_is_not_exact_shows_no_time():
    row = dict(impl="tile_pass", form="dpo", tokens=8, hidden=4, vocab=16, dtype="float32", median_s=0.5,
               interleaved_s=0.4, time_x_inductor=0.9, time_x_floor=1.1, err_loss=1e-7, err_dh=1e-6,
               err_dw=3e-3, err_dextra=1e-6, note="tile=8x1")  # fmt: skip
    assert bench.exactness({**row, "err_dw": 2e-6}) == {"exact": True}
    assert bench.exactness({**row, "err_dextra": float("nan")})["exact"] is False
    assert bench.exactness({**row, "err_dh": None})["exact"] is False  # a gradient that never came
    verdict = bench.exactness(row)
    assert verdict["exact"] is False and "err_dw" in verdict["inexact"]
    shown = bench.format_table([{**row, **verdict}]).splitlines()[1]
    for hidden in ("0.500", "0.400", "0.90", "1.10"):
        assert hidden not in shown
    assert "3.0e-03" in shown  # the error is shown
    assert "0.500" in bench.format_table([{**row, "exact": True}])


def test_only_the_forms_own_rows_run_dpo_and_distill():
    own = ["eager", "inductor", "chunked", "tile_pass"]
    for form in ("dpo", "distill"):
        assert [i for i in bench.IMPLS if bench.runs_form(i, form)] == own
    assert not bench.runs_form("chunked", "ce") and bench.runs_form("torch_chunked", "ce")
    assert not bench.runs_form("torch_chunked", "grpo") and bench.runs_form("autochunker", "grpo")


def test_host_overhead_rows_time_both_backends_per_tile_count(capsys):
    """``--host-overhead``: one row per tile count, both medians measured, and the slope printed."""
    from tile_pass import _bench_host
    from tile_pass.plan import _plan

    with _plan.recorded() as plans:
        rows = _bench_host.measure(tiles=(1, 2), steps=3, warmup=1)
    assert [r["tiles"] for r in rows] == [1, 2]
    for row in rows:
        for suffix in ("_ms", "_forward_ms"):  # a step, and its forward alone
            assert row["aot_eager" + suffix] > 0 and row["tile_pass" + suffix] > 0
            assert row["added" + suffix] == pytest.approx(
                row["tile_pass" + suffix] - row["aot_eager" + suffix]
            )
    assert {(p.rows, p.num_tiles) for p in plans} == {(64, 1), (64, 2)}  # the tiles asked for ran
    text = _bench_host.format_rows(rows)
    assert "per additional tile:" in text and text.count("\n") == 4


def test_distill_with_a_trained_teacher_is_one_region_against_six_gemms():
    """Two trained heads (``distill_trained``): one region whose tiles form both heads' gradients,
    exact against float64 (the teacher's hidden states and weight included), and a floor of six
    GEMMs per token: each head's logits, hidden-state and weight gradients."""
    rows = bench.run_benchmark(
        [SHAPE], ("tile_pass",), repeats=1, warm_cache=True, timeout=300, forms=("distill_trained",),
        inner="aot_eager",
    )  # fmt: skip
    by = {r["impl"]: r for r in rows}
    assert len(by[bench.FLOOR]["gemms"]) == 6, by[bench.FLOOR]["gemms"]
    tiled = by["tile_pass"]
    assert "error" not in tiled, tiled
    report = tiled["report"]  # the report's text
    assert tiled["fired"] and not tiled["skipped"] and report.count("REWRITTEN") == 1, report
    assert "head 2 (hidden @ W.T" in report and "teacher = ht @ wt.t(), trained)" in report, report
    assert "kl_div's gradient" in report and "nll_loss" not in report, report  # the JSD's own loss op
    assert tiled["exact"] is True and max(tiled["err_dh"], tiled["err_dw"], tiled["err_dextra"]) < 1e-4, tiled


def test_dpo_pairs_longer_than_a_tile(monkeypatch):
    """``dpo_sequence`` and ``coupled_tile_mib`` (``--dpo-sequence``, ``--coupled-tile-mib``) make
    every pair longer than a tile: ``dpo_sigmoid`` keeps three GEMMs per labelled token (per-summary
    sums), ``dpo``, whose NLL term gives the chosen tokens a second gradient direction, runs the
    tiles twice (four); both exact, as the profiler counts them in the child."""
    from tile_pass import _bench_forms
    from tile_pass.tiles import _coupled_tiles

    monkeypatch.setattr(_bench_forms, "_sequence", _bench_forms._sequence)  # restored after
    monkeypatch.setattr(_coupled_tiles, "COUPLED_TILE_BYTES", _coupled_tiles.COUPLED_TILE_BYTES)
    for form, gemms in (("dpo_sigmoid", 3), ("dpo", 4)):
        cfg = bench.BenchConfig(
            impl="tile_pass", inner="aot_eager", tokens=512, hidden=32, vocab=500, form=form, repeats=1,
            tile_tokens=32, ignore_every=0, dpo_sequence=128, coupled_tile_mib=0,
        )  # fmt: skip
        row = bench.run_child(cfg)
        assert row["exact"] is True, row
        assert row["gemms_per_token"] == pytest.approx(gemms), row["note"]
        assert f"{gemms}.00 GEMMs per labelled token" in row["note"]
