"""Side-by-side benchmark of LM-head losses: time, memory, compile cost, recompiles, exactness.

    python -m tile_pass.bench --quick                     # a few minutes on a 2-core CPU
    python -m tile_pass.bench --full --json full.json     # N=4096..16384, H=1024..4096, V=32000/128256
    python -m tile_pass.bench --impl inductor,tile_pass --tokens 8192 --hidden 1024 --vocab 128256
    python -m tile_pass.bench --sweep-tile --tokens 4096  # tile_pass's chosen tile against a sweep
    python -m tile_pass.bench --dynamic --tokens 2048     # dynamic=True over 8 sequence lengths

Every (implementation, shape, dtype) is measured in its own fresh interpreter, so no
allocator cache, compiled artefact or Inductor config of one implementation leaks into
another. In that child: compile and warm up (the first call), then ``repeats`` steady
forward+backward steps for time (median) with the minor page faults of each, under the
allocator the user's process has (the child inherits the parent's environment: glibc's
defaults unless the user set ``MALLOC_*``); then one step's peak under those settings; then
glibc is pinned to a 64 KiB mmap threshold and no trim threshold and one more step measures
the peak above the inputs (every freed block leaves the resident set, so the peak is
readable; see :func:`tile_pass._measure.measure_split`). Then the loss and both gradients
are compared with eager float64 computed on the same data in the same process (chunked over
tokens, so the check never needs the ``[N, V]`` float64 logits). Errors are
``max|x - ref| / max|ref|``. Every table is captioned with the CPU (model, family/model,
cores, vector extensions) and the allocator settings, which the JSON records too.

The "gemm_floor" row times the three GEMMs a step cannot avoid (``h @ W.T``,
``dlogits @ W``, ``dlogits.T @ h``) on the same shape, each in every GEMM library the
process can call (aten's, and oneDNN's for CPU float32), and sums the fastest; every row
reports its time relative to it and relative to plain Inductor from the same run. The ``dpo``
and ``distill`` forms (:mod:`tile_pass._bench_forms`) have floors of their own (``distill``'s
adds the frozen teacher's forward GEMM) and a ``chunked`` row (the form's code chunked by hand
under activation checkpointing). A row whose loss or any gradient is further from float64 than
:data:`EXACT_WITHIN` is marked NOT EXACT and the table prints no time for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tile_pass import _bench_forms, _bench_host
from tile_pass._measure import (
    LOSS_FORMS,
    PEAK_ALLOCATOR,
    MiB,
    allocator_env,
    form_inputs,
    measure_split,
    run_fresh,
    timed,
    timed_faults,
    training_step,
)
from tile_pass.plan import _plan
from tile_pass.tiles._tile_passes.onednn_gemms import _onednn_mm, onednn_gemms_apply

#: Every implementation the benchmark knows. CPU-only runs use :func:`default_impls`.
IMPLS = ("eager", "inductor", "autochunker", "torch_chunked", "cce", "chunked", "tile_pass", "liger",
         "cce_kernel")  # fmt: skip
FLOOR = "gemm_floor"
IGNORE_INDEX = -100
#: every loss form: the single-head forms of the step (:data:`LOSS_FORMS`) and the preference
#: and distillation forms with inputs of their own (:mod:`tile_pass._bench_forms`)
FORMS = {**LOSS_FORMS, **_bench_forms.FORMS}
#: the implementations that run the user's own loss code, so every form of LOSS_FORMS
_ANY_FORM = ("eager", "inductor", "autochunker", "tile_pass")
#: ...and those of the ``dpo`` and ``distill`` forms: the same code, and ``chunked``, the form's
#: code chunked by hand over tokens under activation checkpointing, as users write it today
_OWN_FORM_IMPLS = ("eager", "inductor", "chunked", "tile_pass")
#: the largest error against float64 (``max|x - ref| / max|ref|``, loss and every gradient) of
#: a row the table shows a time for; a larger one is a wrong result, not a rounding
EXACT_WITHIN = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 5e-2, "float16": 5e-2}

#: (implementation, logits-sized buffers alive at the peak): a coarse model used only to
#: skip a child that would not fit in the memory available. Eager keeps the logits, their
#: float32 log-probabilities and their gradient (counted in float32); chunked
#: implementations keep none.
_LOGITS_COPIES = {"eager": 4.0}
#: ...counted in the model dtype for these: Inductor fuses the upcast (measured at N=8192,
#: V=128256: 1.13 float32 logits in float32, 1.0 bf16 logits in bfloat16; 1.5 leaves a
#: margin), the GEMM floor holds the logits and a logits-sized gradient.
_MODEL_DTYPE_LOGITS_COPIES = {"inductor": 1.5, "autochunker": 1.5, "gemm_floor": 2.0}
#: ...times this for forms that read the logits more than once (Inductor's GRPO step holds 2, its entropy 4)
_FORM_COPIES = {"grpo": 2, "grpo_trl": 2, "entropy": 3}


@dataclass
class BenchConfig:
    """One measurement: an implementation at one shape and dtype (serialised to the child).

    ``impl`` names a benchmark implementation (see ``IMPLS``). ``inner`` is the compiler of the
    ``inductor`` row (plain ``torch.compile``) and under ``tile_pass``: Inductor, unless a test
    wants a faster compile (``aot_eager``).
    """

    impl: str = "tile_pass"
    inner: str = "inductor"
    tokens: int = 4096
    hidden: int = 1024
    vocab: int = 32000
    dtype: str = "float32"
    device: str = "cpu"
    tile_tokens: int | None = None
    tile_bytes: int | None = None
    repeats: int = 3
    seed: int = 0
    ignore_every: int = 7  # every k-th label is ignore_index (0: none)
    form: str = "ce"  # a key of FORMS
    check: bool = True
    dynamic_lengths: list[int] = field(default_factory=list)  # non-empty: the dynamic-shape check
    dpo_sequence: int | None = None  # tokens per sequence of the dpo forms (None: DPO_SEQUENCE)
    coupled_tile_mib: int | None = None  # tile_pass's byte budget of a tile holding a coupled group


# ------------------------------------------------------------------ the child process


def _make_inputs(cfg: BenchConfig, tokens: int | None = None):
    n = cfg.tokens if tokens is None else tokens
    gen = torch.Generator().manual_seed(cfg.seed + n)
    dtype = getattr(torch, cfg.dtype)
    hidden = torch.randn(n, cfg.hidden, generator=gen).to(device=cfg.device, dtype=dtype)
    weight = torch.randn(cfg.vocab, cfg.hidden, generator=gen) / cfg.hidden**0.5
    weight = torch.nn.Parameter(weight.to(device=cfg.device, dtype=dtype))
    labels = torch.randint(0, cfg.vocab, (n,), generator=gen).to(cfg.device)
    if cfg.ignore_every:  # some ignored tokens, unevenly spread over tiles
        labels[:: cfg.ignore_every] = IGNORE_INDEX
    return hidden.requires_grad_(), weight, labels


def runs_form(impl: str, form: str) -> bool:
    """Whether ``impl`` computes ``form`` (the others compute cross entropy only)."""
    if form in _bench_forms.FORMS:
        return impl in _OWN_FORM_IMPLS
    return impl != "chunked" and (form == "ce" or impl in _ANY_FORM)


def _form_inputs(form: str, hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    """The inputs ``form`` takes after ``(hidden, weight, labels)``; learnable ones require grad."""
    if form in _bench_forms.FORMS:
        return _bench_forms.form_inputs(form, hidden, weight, labels)
    return form_inputs(form, hidden, weight, labels)


def _training_step(fn, hidden, weight, labels, extra):
    """:func:`training_step`, which also clears the gradients of the learnable extra inputs."""
    step = training_step(fn, hidden, weight, labels, extra)
    learnable = [t for t in extra if t.requires_grad]
    if not learnable:
        return step

    def cleared():
        for t in learnable:
            t.grad = None
        return step()

    return cleared


def _instrument_autochunker(events: list[str]) -> None:
    """Record what the AutoChunker did with each joint graph (it fails silently otherwise)."""
    import torch._inductor.compile_fx  # noqa: F401 - registers prims the chunker refers to
    import torch._inductor.fx_passes.auto_chunker as auto_chunker

    torch._inductor.config.auto_chunker.enable = True
    original = auto_chunker.chunk

    def chunk(gm):
        try:
            out = original(gm)
        except auto_chunker.CantChunk as exc:
            events.append(f"CantChunk: {exc}")
            raise
        events.append("chunked" if out is not gm else "unchanged")
        return out

    auto_chunker.chunk = chunk  # joint_graph imports it from the package at call time


def _build(cfg: BenchConfig, info: dict[str, Any]) -> Callable:
    """The loss function of ``cfg.impl``; ``info`` collects what the child should report."""
    dynamic = True if cfg.dynamic_lengths else None
    loss_fn = FORMS[cfg.form]
    if cfg.impl in IMPLS and not runs_form(cfg.impl, cfg.form):
        raise ValueError(f"{cfg.impl} does not compute the {cfg.form!r} form")
    if cfg.impl == "chunked":
        return _bench_forms.chunked(cfg.form)
    if cfg.impl == "eager":
        return loss_fn
    if cfg.impl == "inductor":
        return torch.compile(loss_fn, backend=cfg.inner, dynamic=dynamic)
    if cfg.impl == "autochunker":
        events: list[str] = []
        info["autochunker_events"] = events
        _instrument_autochunker(events)
        return torch.compile(loss_fn, backend="inductor", dynamic=dynamic)
    if cfg.impl == "tile_pass":
        import tile_pass

        backend = tile_pass.backend(cfg.inner, tile_tokens=cfg.tile_tokens, tile_bytes=cfg.tile_bytes)
        info["backend"] = backend
        return torch.compile(loss_fn, backend=backend, dynamic=dynamic)
    if cfg.impl == "torch_chunked":
        from torch.nn import LinearCrossEntropyOptions

        options = LinearCrossEntropyOptions()
        try:  # private, informative only: the chunk size "auto" resolves to here
            adjusted = options._adjust(
                cfg.tokens, cfg.hidden, cfg.vocab, getattr(torch, cfg.dtype), torch.device(cfg.device)
            )
            info["note"] = f"chunk={adjusted.batch_chunk_size} acc={adjusted.acc_policy}"
        except Exception:  # noqa: BLE001 - a private helper; absent in other torch versions
            pass

        def torch_chunked(h, w, y):
            return F.linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, options=options)

        return torch_chunked
    if cfg.impl in ("cce", "cce_kernel"):
        from cut_cross_entropy import linear_cross_entropy as cce_loss

        impl = "torch_compile" if cfg.impl == "cce" else "cce"

        def cce(h, w, y):
            return cce_loss(h, w, y, ignore_index=IGNORE_INDEX, impl=impl)

        return cce
    if cfg.impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        return lambda h, w, y: liger_loss(w, h, y)
    raise ValueError(f"unknown implementation {cfg.impl!r}; choose from {IMPLS}")


def float64_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_bytes: int = 256 * MiB,
    form: str = "ce",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager float64 loss, d loss/d hidden and d loss/d weight (mean over valid tokens).

    A form other than ``"ce"`` is the form's own code run once in float64 (unchunked).

    Chunked over tokens so the oracle fits next to a large-vocab step: each chunk is plain
    ``F.cross_entropy(F.linear(...))`` in float64 with autograd; only summation order differs
    from one whole-batch call, which float64 makes irrelevant.
    """
    h64 = hidden.detach().double()
    w64 = weight.detach().double().requires_grad_()
    if form != "ce":
        h64.requires_grad_()
        extra = [
            t.double() if t.is_floating_point() else t for t in form_inputs(form, hidden, weight, labels)
        ]
        loss = LOSS_FORMS[form](h64, w64, labels, *extra)
        return (loss.detach(), *torch.autograd.grad(loss, (h64, w64)))
    count = (labels != IGNORE_INDEX).sum().double()
    rows = max(1, chunk_bytes // (8 * weight.shape[0] * 2))
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grad_h = torch.empty_like(h64)
    grad_w = torch.zeros_like(w64)
    for start in range(0, h64.shape[0], rows):
        h_c = h64[start : start + rows].requires_grad_()
        part = F.cross_entropy(
            F.linear(h_c, w64), labels[start : start + rows], ignore_index=IGNORE_INDEX, reduction="sum"
        )
        part = part / count
        g_h, g_w = torch.autograd.grad(part, (h_c, w64))
        grad_h[start : start + rows] = g_h
        grad_w += g_w
        loss += part.detach()
    return loss, grad_h, grad_w


def relative_error(value: torch.Tensor | None, reference: torch.Tensor) -> float | None:
    """``max|value - reference| / max|reference|`` (the test-suite tolerance convention)."""
    if value is None:
        return None
    scale = reference.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((value.detach().double() - reference).abs().max() / scale)


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _tile_traces() -> int:
    """Tile functions traced so far by tile_pass (a private cache; 0 if it moved)."""
    try:
        from tile_pass.tiles import _tile_kernel

        return len(_tile_kernel._cache)
    except (ImportError, AttributeError):
        return 0


def _products(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[Callable]]:
    """``a @ b`` for each pair, per GEMM library this process can call for them."""
    gemms = {"aten": [lambda a=a, b=b: a @ b for a, b in pairs]}
    if pairs[0][0].dtype == torch.float32 and onednn_gemms_apply(pairs[0][0].device):
        gemms["onednn"] = [lambda a=a, b=b: _onednn_mm(a, b) for a, b in pairs]
    return gemms


def _floor_gemms(h: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, list[Callable]]:
    """The three unavoidable GEMMs, per GEMM library this process can call for them."""
    return _products([(h, w.T), (g, w), (g.T, h)])


def _floor_operands(cfg: BenchConfig) -> tuple[list[str], dict[str, list[Callable]]]:
    """The names of the GEMMs ``cfg.form``'s step cannot avoid and, per library, each GEMM."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    h = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(device, dtype)
    w = torch.randn(cfg.vocab, cfg.hidden, generator=gen).to(device, dtype)
    g = torch.randn(cfg.tokens, cfg.vocab, generator=gen).to(device, dtype)
    if cfg.form not in _bench_forms.FORMS:
        return ["h @ W.T", "dlogits @ W", "dlogits.T @ h"], _floor_gemms(h, w, g)
    _, _, labels = _make_inputs(cfg)
    extra = [t.detach() for t in _form_inputs(cfg.form, h, w, labels)]
    named = _bench_forms.floor_gemms(cfg.form, h, w, g, extra)
    return [name for name, _, _ in named], _products([(a, b) for _, a, b in named])


def _floor_step(cfg: BenchConfig) -> Callable[[], None]:
    """One run of the floor's GEMMs, each in the library that was fastest at it here (for
    the interleaved timing: :func:`run_interleaved`)."""
    device = torch.device(cfg.device)
    _, libraries = _floor_operands(cfg)
    for gemms in libraries.values():
        for gemm in gemms:
            gemm()
    timings = {name: [min(timed(gemm, device)[1] for _ in range(2)) for gemm in gemms]
               for name, gemms in libraries.items()}  # fmt: skip
    fastest = [
        libraries[min(libraries, key=lambda name, i=i: timings[name][i])][i]
        for i in range(len(libraries["aten"]))
    ]

    def step() -> None:
        for gemm in fastest:
            gemm()

    return step


def _gemm_floor(cfg: BenchConfig) -> dict[str, Any]:
    """Each GEMM of the form's floor timed in every library available; the floor sums the fastest.

    tile_pass's CPU float32 tiles call oneDNN where aten would call MKL, so a floor of
    aten's GEMMs alone would not bound them. Each GEMM allocates its output, as an unsplit step
    does: an ``[N, V]`` output is above glibc's 32 MiB mmap ceiling and faulted in on every call
    (``faults_median``), which a tiled step's heap-sized tiles do not pay, so a tiled step can
    read below 1x the floor.
    """
    device = torch.device(cfg.device)
    names, libraries = _floor_operands(cfg)
    first = sum(timed(gemm, device)[1] for gemm in libraries["aten"])
    per_library = {}  # timed under the process's own allocator, as every implementation is
    faults = {}
    for library, gemms in libraries.items():
        for gemm in gemms:  # a second warm-up: thread pools and allocator settle
            gemm()
        runs = [[timed_faults(gemm, device)[1:] for gemm in gemms] for _ in range(max(1, cfg.repeats))]
        per_library[library] = [statistics.median(t for t, _ in column) for column in zip(*runs, strict=True)]
        faults[library] = [statistics.median(f for _, f in column) for column in zip(*runs, strict=True)]
    fastest = [min(times) for times in zip(*per_library.values(), strict=True)]
    chosen = [min(per_library, key=lambda name, i=i: per_library[name][i]) for i in range(len(fastest))]
    return {
        "median_s": sum(fastest),
        # the faults of the fastest library's GEMMs (each writes a fresh output, as a step does)
        "faults_median": sum(faults[library][i] for i, library in enumerate(chosen)),
        "allocator": {"timing": allocator_env() or "glibc defaults"},
        "first_call_s": first,
        "compile_s": 0.0,
        "gemms": names,
        "gemm_s": {library: [round(t, 4) for t in times] for library, times in per_library.items()},
        "note": " + ".join(names),
    }


def _dynamic_check(cfg: BenchConfig, fn: Callable) -> dict[str, Any]:
    """Run every length in ``cfg.dynamic_lengths`` once; record new graphs and tile traces."""
    device = torch.device(cfg.device)
    per_length = []
    for n in cfg.dynamic_lengths:
        hidden, weight, labels = _make_inputs(cfg, tokens=n)
        graphs, traces = _graph_count(), _tile_traces()
        step = _training_step(fn, hidden, weight, labels, _form_inputs(cfg.form, hidden, weight, labels))
        _, seconds = timed(step, device)
        per_length.append(
            {
                "tokens": n,
                "seconds": seconds,
                "new_graphs": _graph_count() - graphs,
                "new_tile_traces": _tile_traces() - traces,
            }
        )
    return {"lengths": per_length, "graphs": _graph_count(), "recompiles": max(0, _graph_count() - 1)}


def _use_coupled_tile_budget(mib: int | None) -> None:
    """``--coupled-tile-mib``: the bytes a tile may grow to so that it holds a coupled group (a
    DPO pair), scaled down with a small benchmark shape so that its pairs exceed it, as a pair of
    2 x 2048 tokens exceeds the default budget at V=128256."""
    if mib is not None:
        from tile_pass.tiles import _coupled_tiles

        _coupled_tiles.COUPLED_TILE_BYTES = mib * MiB


def run_child(cfg: BenchConfig) -> dict[str, Any]:
    """Measure ``cfg`` in this process (meant to be a fresh one; see :func:`measure_fresh`)."""
    device = torch.device(cfg.device)
    _bench_forms.use_dpo_sequence(cfg.dpo_sequence)
    _use_coupled_tile_budget(cfg.coupled_tile_mib)
    out: dict[str, Any] = {**asdict(cfg), "torch": torch.__version__}
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    out["logits_mib"] = cfg.tokens * cfg.vocab * itemsize / MiB
    if cfg.impl == FLOOR:
        return {**out, **_gemm_floor(cfg)}

    torch.manual_seed(cfg.seed)
    info: dict[str, Any] = {}
    fn = _build(cfg, info)
    if cfg.dynamic_lengths:
        return {**out, **_dynamic_check(cfg, fn)}

    hidden, weight, labels = _make_inputs(cfg)
    extra = _form_inputs(cfg.form, hidden, weight, labels)
    step = _training_step(fn, hidden, weight, labels, extra)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, first = timed(step, device)
    graphs_after_first = _graph_count()
    learnable = [t for t in (hidden, weight, *extra) if t.requires_grad]

    def clear() -> None:  # the gradients a step returns are part of its peak
        for t in learnable:
            t.grad = None

    clear()
    with _plan.recorded() as plans:  # what the tile loops ran: the plan depends on the labels
        measured = measure_split(step, device, cfg.repeats, clear)
    times, loss, peak = sorted(measured.times), measured.loss, measured.peak_above
    median = statistics.median(times)
    notes = []
    fallback = [str(w.message) for w in caught if "linear_cross_entropy" in str(w.message)]
    if cfg.impl == "torch_chunked":
        notes.append("FELL BACK to reference: " + fallback[0][:120] if fallback else "chunked path")
    if "note" in info:
        notes.append(info["note"])
    if "autochunker_events" in info:
        events = info["autochunker_events"]
        out["fired"] = fired = "chunked" in events
        notes.append(("fired" if fired else "did not fire") + (f" ({'; '.join(events)})" if events else ""))
    if "backend" in info:
        report = info["backend"].report()
        rewrites = report.rewrites
        out["fired"] = bool(rewrites)
        out["report"] = str(report)
        if rewrites:  # how the region's gradient is formed (e.g. re-derived in backward: a 4th GEMM)
            out["reduction"] = rewrites[0].reduction
            if cfg.form in _bench_forms.FORMS:
                notes.append(f"reduction={rewrites[0].reduction}")
        out["skipped"] = [skip.reason for skip in report.skipped]
        if rewrites and cfg.form in _bench_forms.FORMS:
            clear()
            out["gemms_per_token"] = _gemms_per_token(step, cfg, labels)
            notes.append(f"{out['gemms_per_token']:.2f} GEMMs per labelled token (profiler)")
        if rewrites:
            ran = plans[-1] if plans else None
            out["tile_tokens"] = ran.tile if ran else rewrites[0].tile_tokens
            notes.append(
                f"tile={ran.tile}x{ran.num_tiles} {ran.schedule.value}"
                if ran
                else f"tile={rewrites[0].tile_tokens}"
            )
        else:
            notes.append("NOT REWRITTEN" + (f" ({out['skipped'][0][:160]})" if out["skipped"] else ""))
    out.update(
        loss=float(loss.detach()),
        median_s=median,
        # every timed step, sorted: the spread behind the median (this VM's steps vary by 10-20%)
        steps_s=[round(t, 4) for t in times],
        # minor page faults of each timed step, in step order (steps_in_order_s beside them)
        faults_per_step=measured.faults,
        steps_in_order_s=[round(t, 4) for t in measured.times],
        faults_median=statistics.median(measured.faults),
        first_call_s=first,
        # the first call maps its buffers fresh (glibc's threshold starts at 128 KiB) as the
        # peak step does under the pinned allocator, so their difference is the compile, not faults
        compile_s=max(0.0, first - measured.peak_step_s),
        memory_step_s=measured.peak_step_s,
        peak_step_faults=measured.peak_faults,
        peak_mib=peak / MiB,
        # the same step's peak under the timing's allocator (glibc's own thresholds, history included)
        peak_glibc_mib=measured.peak_above_steady / MiB,
        allocator={
            "timing": allocator_env() or "glibc defaults",
            "peak": PEAK_ALLOCATOR if measured.peak_pinned else "as timing (allocator not glibc)",
        },
        # what the step needs beyond the gradients it must return (hidden and weight, model dtype)
        extra_mib=(peak - (cfg.tokens + cfg.vocab) * cfg.hidden * itemsize) / MiB,
        graphs=_graph_count(),
        recompiles=max(0, _graph_count() - 1),
        steady_new_graphs=_graph_count() - graphs_after_first,
        note="; ".join(notes),
    )
    if cfg.check:
        learnable = [t for t in extra if t.requires_grad]
        grads = (hidden.grad, weight.grad, *(t.grad for t in learnable))
        del loss
        if cfg.form in _bench_forms.FORMS:
            ref_loss, refs = _bench_forms.float64_reference(cfg.form, hidden, weight, labels, extra)
        else:
            ref_loss, *refs = float64_reference(hidden, weight, labels, form=cfg.form)
        # GRPO's loss is exactly -mean(advantages) at ratio 1 (zero here): absolute error then
        out["err_loss"] = abs(out["loss"] - float(ref_loss)) / (abs(float(ref_loss)) or 1.0)
        out["err_dh"] = relative_error(grads[0], refs[0])
        out["err_dw"] = relative_error(grads[1], refs[1])
        if learnable:  # the dpo bias
            errors = [relative_error(g, r) for g, r in zip(grads[2:], refs[2:], strict=True)]
            out["err_dextra"] = max(math.inf if e is None else e for e in errors)
        out.update(exactness(out))
        if not out["exact"]:
            out["note"] = f"NOT EXACT ({out['inexact']}); " + out["note"]
    return out


def exactness(row: dict[str, Any]) -> dict[str, Any]:
    """``exact``: whether the loss and every gradient are within :data:`EXACT_WITHIN` of float64
    (a missing gradient or a NaN is not); ``inexact`` names the errors beyond it."""
    within = EXACT_WITHIN.get(row["dtype"], 5e-2)
    keys = ["err_loss", "err_dh", "err_dw"] + (["err_dextra"] if "err_dextra" in row else [])
    bad = [key for key in keys if not (row.get(key) is not None and row[key] <= within)]
    return {"exact": not bad, **({"inexact": ", ".join(f"{k}={row.get(k)}" for k in bad)} if bad else {})}


#: the profiler's names of a step's GEMMs, and where each finds its ``[M, K]`` and ``[K, N]``
#: operands' sizes: aten's, and oneDNN's linear (``[M, K]``, ``[N, K]``) that float32 CPU tiles run
_GEMM_OPERANDS = {
    "aten::mm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::addmm_": (1, 2),
    "mkldnn::_linear_pointwise": (0, 1),
}


def _gemms_per_token(step, cfg: BenchConfig, labels: torch.Tensor) -> float:
    """One step's GEMM work, from the profiler's record of every GEMM and its operand sizes, in
    units of one ``[V, H]`` GEMM per labelled token (``2 * V * H`` flops): three for a step that
    forms every gradient in forward, four where the logits GEMM runs twice."""
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    flops = 0
    for event in prof.events():
        where = _GEMM_OPERANDS.get(event.name)
        if where is None or len(event.input_shapes) <= where[1]:
            continue
        (m, k), second = event.input_shapes[where[0]], event.input_shapes[where[1]]
        flops += 2 * m * k * (second[0] if event.name.startswith("mkldnn") else second[1])
    tokens = int((labels != IGNORE_INDEX).sum())
    return flops / (2 * cfg.vocab * cfg.hidden * max(tokens, 1))


def run_interleaved(cfgs: Sequence[BenchConfig], rounds: int) -> list[dict[str, list]]:
    """Each config's step times and minor page faults (``{"times": [...], "faults": [...]}``,
    by round), measured in this one process with the steps interleaved, under the allocator the
    process was started with.

    ``cfgs`` share one shape (any implementations and forms). Every round runs one step of each,
    every other round in reverse order, so a slow spell of the machine costs every config alike;
    one fresh process per row instead times each config minutes apart (on a shared 2-core VM,
    rows of one run moved 10-20% while interleaved steps of the same pair moved a few percent).
    Memory is not measured here: every config's compiled code lives in this one process. A
    GEMM floor's step runs its GEMMs, each in the library fastest at it (:func:`_floor_step`).
    """
    device = torch.device(cfgs[0].device)
    _bench_forms.use_dpo_sequence(cfgs[0].dpo_sequence)
    _use_coupled_tile_budget(cfgs[0].coupled_tile_mib)
    hidden, weight, labels = _make_inputs(cfgs[0])
    steps = []
    for cfg in cfgs:
        if cfg.impl == FLOOR:
            steps.append(_floor_step(cfg))
            continue
        torch.manual_seed(cfg.seed)
        fn = _build(cfg, {})
        step = _training_step(fn, hidden, weight, labels, _form_inputs(cfg.form, hidden, weight, labels))
        step()  # compile
        step()  # and one warm step
        steps.append(step)
    measured: list[dict[str, list]] = [{"times": [], "faults": []} for _ in cfgs]
    for round_index in range(rounds):
        order = range(len(cfgs)) if round_index % 2 == 0 else reversed(range(len(cfgs)))
        for i in order:
            _, seconds, faults = timed_faults(steps[i], device)
            measured[i]["times"].append(seconds)
            measured[i]["faults"].append(faults)
    return measured


# ------------------------------------------------------------------ the parent process


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimated_peak_bytes(cfg: BenchConfig) -> int:
    """A coarse upper estimate of a child's resident memory (inputs, grads, logits buffers)."""
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    if cfg.form in _bench_forms.FORMS:
        return _own_form_peak_bytes(cfg, itemsize)
    if cfg.impl in _MODEL_DTYPE_LOGITS_COPIES:
        copies = _MODEL_DTYPE_LOGITS_COPIES[cfg.impl] * _FORM_COPIES.get(cfg.form, 1)
        logits = copies * cfg.tokens * cfg.vocab * itemsize
    else:
        logits = _LOGITS_COPIES.get(cfg.impl, 0.5) * cfg.tokens * cfg.vocab * max(itemsize, 4)
    params = (cfg.tokens + cfg.vocab) * cfg.hidden * (2 * itemsize + (16 if cfg.check else 0))
    return int(logits + params + 1024 * MiB)


#: float32 logits-sized buffers alive at the peak of the ``dpo`` and ``distill`` forms, per row
#: (``chunked``: of one chunk's tokens; the float64 check holds about as many of its chunks)
_OWN_FORM_COPIES = {
    ("eager", "dpo"): 6, ("inductor", "dpo"): 4, ("chunked", "dpo"): 8,
    ("eager", "dpo_sigmoid"): 6, ("inductor", "dpo_sigmoid"): 4, ("chunked", "dpo_sigmoid"): 8,
    ("gemm_floor", "dpo_sigmoid"): 2,
    ("eager", "distill"): 12, ("inductor", "distill"): 8, ("chunked", "distill"): 16,
    ("eager", "distill_trained"): 14, ("inductor", "distill_trained"): 10, ("chunked", "distill_trained"): 18,
    ("gemm_floor", "dpo"): 2, ("gemm_floor", "distill"): 2, ("gemm_floor", "distill_trained"): 2,
}  # fmt: skip


def _own_form_peak_bytes(cfg: BenchConfig, itemsize: int) -> int:
    """:func:`estimated_peak_bytes` of the ``dpo`` and ``distill`` forms (their own inputs: the
    teacher's hidden states and head; the chunked rows' and the check's chunks)."""
    row_bytes = cfg.vocab * max(itemsize, 4)
    rows = min(cfg.tokens, _bench_forms.CHUNK_TOKENS) if cfg.impl == "chunked" else cfg.tokens
    logits = _OWN_FORM_COPIES.get((cfg.impl, cfg.form), 0.5) * rows * row_bytes
    teacher = cfg.form in _bench_forms.TEACHER_FORMS
    width = cfg.hidden + (round(cfg.hidden * _bench_forms.TEACHER_WIDTH) if teacher else 0)
    params = (cfg.tokens + cfg.vocab) * width * (2 * itemsize + (16 if cfg.check else 0))
    check = 16 * _bench_forms.CHUNK_TOKENS * cfg.vocab * 8 if cfg.check else 0
    return int(logits + params + check + 1024 * MiB)


def measure_fresh(
    cfg: BenchConfig, timeout: float = 3600, warm_cache: bool = False, mem_fraction: float = 0.8
) -> dict[str, Any]:
    """Run :func:`run_child` in a fresh interpreter; failures become a row with ``error`` set.

    Inductor's on-disk caches are disabled unless ``warm_cache``, so ``compile_s`` is a
    cold compile. A child estimated not to fit in ``mem_fraction`` of the available memory
    is skipped rather than risking the machine.
    """
    row: dict[str, Any] = asdict(cfg)
    available = _mem_available_bytes() if cfg.device == "cpu" else None
    need = estimated_peak_bytes(cfg)
    if available is not None and need > mem_fraction * available:
        return {**row, "error": f"skipped: needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} available"}
    env = {} if warm_cache else {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    if cfg.impl == "autochunker":
        env["TORCHINDUCTOR_AUTO_CHUNKER"] = "1"
    try:
        argv = ["-m", "tile_pass.bench", "--child", json.dumps(asdict(cfg))]
        # the user's allocator (glibc's defaults unless set): the child pins it for the peak itself
        return run_fresh(argv, timeout, env, allocator={})
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return {**row, "error": lines[-1][:200] if lines else "failed"}


def importable(module: str) -> bool:
    """Whether an optional implementation's package can be imported."""
    return importlib.util.find_spec(module) is not None


def default_impls(device: str) -> list[str]:
    """The implementations that can run here: optional ones only when installed."""
    impls = ["eager", "inductor", "autochunker"]
    if hasattr(F, "linear_cross_entropy"):
        impls.append("torch_chunked")
    if importable("cut_cross_entropy"):
        impls.append("cce")
    impls.append("tile_pass")
    if device == "cuda":
        if importable("liger_kernel"):
            impls.append("liger")
        if importable("cut_cross_entropy"):
            impls.append("cce_kernel")
    return impls


def _shape_key(row: dict[str, Any]) -> tuple:
    return (row["tokens"], row["hidden"], row["vocab"], row["dtype"], row["device"], row.get("form", "ce"))


def _ratio_time(row: dict[str, Any], base: dict[str, Any]) -> float:
    """``row``'s time over ``base``'s: the median of their steps' ratios round by round where both
    were interleaved (:func:`run_interleaved`: a slow spell slows both), else their own medians."""
    if "interleaved_s" in row and "interleaved_s" in base:
        pairs = zip(row["interleaved_steps_s"], base["interleaved_steps_s"], strict=True)
        return statistics.median(mine / theirs for mine, theirs in pairs)
    return row["median_s"] / base["median_s"]


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time, memory and compile ratios against plain inductor and the GEMM floor of each shape."""
    for row in rows:
        same = [r for r in rows if _shape_key(r) == _shape_key(row) and "error" not in r]
        base = next((r for r in same if r["impl"] == "inductor"), None)
        # the GEMMs, and the plain cross entropy, are the same for every form of a shape
        same_shape = [r for r in rows if _shape_key(r)[:-1] == _shape_key(row)[:-1] and "error" not in r]
        # a form's own floor (its GEMMs: the teacher's too), else the single head's
        floors = [r for r in same_shape if r["impl"] == FLOOR]
        floor = next((r for r in floors if r.get("form", "ce") == row.get("form", "ce")), None)
        floor = floor or next((r for r in floors if r.get("form", "ce") == "ce"), None)
        plain_ce = next((r for r in same_shape if r["impl"] == row["impl"] and r.get("form", "ce") == "ce"
                         and not r.get("swept")), None)  # fmt: skip
        if "error" in row:
            continue
        if base is not None:
            row["time_x_inductor"] = _ratio_time(row, base)
            if row.get("peak_mib") is not None and base.get("peak_mib"):
                row["mem_x_inductor"] = row["peak_mib"] / base["peak_mib"]
            if row.get("extra_mib") is not None and base.get("extra_mib"):
                row["extra_x_inductor"] = row["extra_mib"] / base["extra_mib"]
            if row.get("peak_glibc_mib") and base.get("peak_glibc_mib"):
                row["glibc_x_inductor"] = row["peak_glibc_mib"] / base["peak_glibc_mib"]
            if row["impl"] != FLOOR and base.get("compile_s"):
                row["compile_x_inductor"] = row["compile_s"] / base["compile_s"]
        if floor is not None:
            row["time_x_floor"] = _ratio_time(row, floor)
        if plain_ce is not None and row.get("form", "ce") != "ce":
            row["time_x_ce"] = _ratio_time(row, plain_ce)
    return rows


def run_benchmark(
    shapes: Iterable[tuple[int, int, int, str]],
    impls: Sequence[str],
    *,
    device: str = "cpu",
    repeats: int = 3,
    check: bool = True,
    floor: bool = True,
    tile_tokens: Sequence[int | None] = (None,),
    timeout: float = 3600,
    warm_cache: bool = False,
    ignore_every: int = 7,
    progress: Callable[[dict[str, Any]], None] | None = None,
    forms: Sequence[str] = ("ce",),
    interleave: int = 0,
    inner: str = "inductor",
    dpo_sequence: int | None = None,
    coupled_tile_mib: int | None = None,
) -> list[dict[str, Any]]:
    """Measure every implementation at every ``(tokens, hidden, vocab, dtype)``, one child each.

    ``tile_tokens`` lists the tiles tile_pass runs at (``None``: its own choice);
    ``ignore_every=k`` ignores every k-th label (0: none); ``interleave=k``: one more child per
    shape times every row's step in ``k`` interleaved rounds, and the ratios use those times;
    ``inner``: the compiler of the ``inductor`` row and inside tile_pass (tests: ``aot_eager``);
    ``dpo_sequence``: tokens per sequence of the ``dpo`` forms (``None``: their default);
    ``coupled_tile_mib``: tile_pass's budget for a tile that holds a coupled group (``None``: its own).
    """
    rows = []
    for tokens, hidden, vocab, dtype in shapes:
        shape = dict(
            tokens=tokens,
            hidden=hidden,
            vocab=vocab,
            dtype=dtype,
            device=device,
            ignore_every=ignore_every,
            dpo_sequence=dpo_sequence,
            coupled_tile_mib=coupled_tile_mib,
        )
        # one floor for the single-head forms, one per form with GEMMs of its own
        floor_forms = [f for f in forms if f in _bench_forms.FORMS]
        if any(f not in _bench_forms.FORMS for f in forms):
            floor_forms.insert(0, "ce")
        configs = [BenchConfig(impl=FLOOR, repeats=repeats, check=False, form=f, **shape)
                   for f in (floor_forms if floor else ())]  # fmt: skip
        configs += [
            BenchConfig(
                impl=impl, tile_tokens=tile, repeats=repeats, check=check, form=form, inner=inner, **shape
            )
            for form in forms
            for impl in impls
            if runs_form(impl, form)
            for tile in (tile_tokens if impl == "tile_pass" else (None,))
        ]
        shape_rows = []
        for cfg in configs:
            row = measure_fresh(cfg, timeout=timeout, warm_cache=warm_cache)
            row["swept"] = cfg.impl == "tile_pass" and cfg.tile_tokens is not None
            shape_rows.append(row)
            if progress is not None:
                progress(row)
        if interleave:
            _time_interleaved(configs, shape_rows, interleave, timeout, warm_cache)
        rows += shape_rows
    return add_ratios(rows)


def _time_interleaved(configs, rows, rounds: int, timeout: float, warm_cache: bool) -> None:
    """Add ``interleaved_s`` (and the steps behind it) to the rows of one shape that measured,
    from one fresh process timing them all interleaved (:func:`run_interleaved`)."""
    # (not the autochunker: its switch would apply to every Inductor row of the one process)
    pairs = zip(configs, rows, strict=True)
    measured = [(c, row) for c, row in pairs if c.impl != "autochunker" and "error" not in row]
    if all(c.impl == FLOOR for c, _ in measured):
        return
    if not measured:
        return
    configs_json = json.dumps([asdict(c) for c, _ in measured])
    argv = ["-m", "tile_pass.bench", "--child-interleaved", str(rounds), configs_json]
    env = {} if warm_cache else {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    try:
        result = run_fresh(argv, timeout * len(measured), env, allocator={})
    except (subprocess.TimeoutExpired, RuntimeError) as exc:
        result = [str(exc).splitlines()[-1][:200] if str(exc) else "failed"] * len(measured)
    for (_, row), steps in zip(measured, result, strict=True):
        if isinstance(steps, str):
            row["interleaved_error"] = steps
        else:
            row["interleaved_s"] = statistics.median(steps["times"])
            row["interleaved_steps_s"] = steps["times"]  # by round
            row["interleaved_faults"] = steps["faults"]
            row["interleaved_faults_median"] = statistics.median(steps["faults"])


def dynamic_lengths(top: int, hidden: int, vocab: int) -> list[int]:
    """8 sequence lengths from 25% to 100% of ``top``, none equal to ``hidden`` or ``vocab``.

    Dynamo's duck sizing gives equal sizes one symbol: a first call whose length equals the
    hidden size makes ``hidden`` ``[s, s]``, the matmul against the static weight then
    specialises ``s`` to ``H``, and the next length recompiles, for any backend. That is a
    property of the first call's shapes, not of what is measured, so such lengths are moved.
    """
    lengths = set()
    for fraction in (0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0):
        n = max(16, round(top * fraction))
        while n in (hidden, vocab) or n in lengths:
            n += 1
        lengths.add(n)
    return sorted(lengths)


def run_dynamic(
    impls: Sequence[str],
    lengths: Sequence[int],
    *,
    hidden: int,
    vocab: int,
    dtype: str,
    device: str = "cpu",
    timeout: float = 3600,
    warm_cache: bool = False,
) -> list[dict[str, Any]]:
    """Compile each implementation with ``dynamic=True`` and run ``lengths`` in one child."""
    shape = dict(tokens=max(lengths), hidden=hidden, vocab=vocab, dtype=dtype, device=device)
    return [
        measure_fresh(BenchConfig(impl=impl, check=False, dynamic_lengths=list(lengths), **shape),
                      timeout=timeout, warm_cache=warm_cache)
        for impl in impls
    ]  # fmt: skip


# ------------------------------------------------------------------ table output

COLUMNS = (
    ("impl", "impl", "{}"),
    ("form", "form", "{}"),
    ("tokens", "N", "{}"),
    ("hidden", "H", "{}"),
    ("vocab", "V", "{}"),
    ("dtype", "dtype", "{}"),
    ("median_s", "step s", "{:.3f}"),
    ("faults_median", "faults/step", "{:.0f}"),
    ("interleaved_s", "interleaved s", "{:.3f}"),
    ("interleaved_faults_median", "int. faults", "{:.0f}"),
    ("peak_mib", "peak MiB", "{:.0f}"),
    ("extra_mib", "extra MiB", "{:.0f}"),
    ("peak_glibc_mib", "glibc MiB", "{:.0f}"),
    ("peak_step_faults", "peak faults", "{:.0f}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("recompiles", "recomp", "{}"),
    ("err_loss", "err loss", "{:.1e}"),
    ("err_dh", "err dh", "{:.1e}"),
    ("err_dw", "err dW", "{:.1e}"),
    ("err_dextra", "err db", "{:.1e}"),
    ("time_x_inductor", "time/ind", "{:.2f}"),
    ("mem_x_inductor", "mem/ind", "{:.2f}"),
    ("extra_x_inductor", "extra/ind", "{:.3f}"),
    ("glibc_x_inductor", "glibc/ind", "{:.2f}"),
    ("compile_x_inductor", "compile/ind", "{:.2f}"),
    ("time_x_floor", "time/floor", "{:.2f}"),
    ("time_x_ce", "time/ce", "{:.2f}"),
    ("note", "note", "{}"),
)


#: the columns a row that is not exact (:func:`exactness`) shows no number in
_TIMES = ("median_s", "interleaved_s", "time_x_inductor", "time_x_floor", "time_x_ce", "compile_x_inductor")


#: the columns of a step's memory and compile, which the GEMM floor has none of
_NOT_FLOOR = ("peak_mib", "extra_mib", "peak_glibc_mib", "compile_s", "peak_step_faults")


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    if key == "note" and "error" in row:
        return "ERROR: " + row["error"]
    if key in _TIMES and row.get("exact") is False:
        return "-"
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if row["impl"] == FLOOR and key in _NOT_FLOOR:
        return "-"
    return fmt.format(value)


def table_caption(machine: dict[str, Any], rows: Sequence[dict[str, Any]] = ()) -> str:
    """What a table was measured on and under which allocator settings: numbers of one CPU
    model do not carry to another (AVX2 and AVX-512 machines order the implementations
    differently), and a step timed under a peak-reading allocator pays page faults a training
    process does not."""
    timing = next((r["allocator"]["timing"] for r in rows if isinstance(r.get("allocator"), dict)), None)
    timing = timing if timing is not None else allocator_env() or "glibc defaults"
    if isinstance(timing, dict):
        timing = " ".join(f"{k}={v}" for k, v in timing.items())
    peak = " ".join(f"{k}={v}" for k, v in PEAK_ALLOCATOR.items())
    return (
        f"CPU: {cpu_label(machine)}; torch {machine.get('torch', '?')}; "
        f"steps timed under {timing} (faults/step: minor page faults); peak step under mallopt {peak}"
    )


def cpu_label(machine: dict[str, Any]) -> str:
    """``AMD EPYC (family/model 26/2), 2 cores, avx2 avx512f ...``: the model name alone does not
    tell EPYC generations apart."""
    label = str(machine.get("cpu", "?"))
    if "cpu_family_model" in machine:
        label += f" (family/model {machine['cpu_family_model']})"
    label += f", {machine.get('cores', '?')} cores"
    if machine.get("vector_isa"):
        label += ", " + " ".join(machine["vector_isa"])
    return label


def format_table(
    rows: Sequence[dict[str, Any]], markdown: bool = False, machine: dict[str, Any] | None = None
) -> str:
    """The rows as an aligned text table (or a Markdown table), under a caption naming the CPU
    and the allocator settings (:func:`table_caption`) where ``machine`` is given."""
    header = [title for _, title, _ in COLUMNS]
    body = [[_cell(row, key, fmt) for key, _, fmt in COLUMNS] for row in rows]
    caption = [table_caption(machine, rows)] if machine is not None else []
    if markdown:
        caption = [f"*{line}*\n" for line in caption]
        lines = [*caption, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join(caption + ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
                                 for cells in [header, *body]])  # fmt: skip


def format_dynamic(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (implementation, length): new graphs compiled and tile functions traced."""
    lines = ["impl        N       step+compile s  new graphs  new tile traces"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['impl']:<11} ERROR: {row['error']}")
            continue
        for item in row["lengths"]:
            lines.append(
                f"{row['impl']:<11} {item['tokens']:<7} {item['seconds']:<15.2f} "
                f"{item['new_graphs']:<11} {item['new_tile_traces']}"
            )
        lines.append(f"{row['impl']:<11} total: {row['graphs']} graph(s), {row['recompiles']} recompile(s)")
    return "\n".join(lines)


#: ``lscpu`` flags that decide which GEMM kernels run (bf16 on AVX-512 BF16 or on AMX tiles): the
#: bf16 GEMM floor of the Xeon (AMX) and the AMD EPYC this project ran on differ by 1.45x, and
#: lscpu names every EPYC generation "AMD EPYC", so the rows record the flags and family/model
_GEMM_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
#: the vector extensions a row records (``vector_isa``): the width decides what Inductor's fused
#: softmax and the tiles' passes cost per row of logits
_VECTOR_PREFIXES = ("avx2", "avx512", "avx_vnni", "amx", "fma")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    facts: dict[str, str] = {}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            name, _, value = line.partition(":")
            facts.setdefault(name.strip(), value.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    info = {
        "cpu": facts.get("Model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if "CPU family" in facts:
        info["cpu_family_model"] = f"{facts['CPU family']}/{facts.get('Model', '?')}"
    if "Flags" in facts:
        flags = set(facts["Flags"].split())
        info["gemm_isa"] = [flag for flag in _GEMM_FLAGS if flag in flags]
        info["vector_isa"] = sorted(flag for flag in flags if flag.startswith(_VECTOR_PREFIXES))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ------------------------------------------------------------------ CLI

QUICK = [(n, 512, 32000, "float32") for n in (1024, 2048)] + [(2048, 512, 32000, "bfloat16")]
FULL = [
    (n, h, v, dt)
    for dt in ("float32", "bfloat16")
    for v in (32000, 128256)
    for h in (1024, 4096)
    for n in (4096, 8192, 16384)
]
SWEEP_TILES = (128, 256, 512, 1024, 2048, 4096, 8192)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tile_pass.bench",
        description="Side-by-side benchmark of LM-head losses (one fresh process per measurement).",
    )
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="N=1024,2048 H=512 V=32000 fp32 + one bf16")
    preset.add_argument("--full", action="store_true", help="N=4096..16384, H=1024/4096, V=32000/128256")
    p.add_argument("--impl", help=f"comma-separated subset of {','.join(IMPLS)} (default: what runs here)")
    p.add_argument("--tokens", type=_ints, default=[4096], help="comma-separated N values")
    p.add_argument("--hidden", type=_ints, default=[1024])
    p.add_argument("--vocab", type=_ints, default=[32000])
    p.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16,float16")
    p.add_argument(
        "--form", default="ce",
        help=f"comma-separated loss forms: {','.join(FORMS)} (dpo and distill: eager, inductor, chunked and "
        "tile_pass by default, each against the form's own GEMM floor)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3, help="steady steps per measurement (median)")
    p.add_argument(
        "--interleave", type=int, default=0, metavar="ROUNDS",
        help="also time every row of a shape in one process, steps interleaved over ROUNDS rounds; "
        "the time ratios then use those times (robust to a noisy machine)",
    )  # fmt: skip
    p.add_argument("--ignore-every", type=int, default=7, help="every k-th label is ignored (0: none)")
    p.add_argument(
        "--dpo-sequence", type=int, metavar="TOKENS",
        help=f"tokens per sequence of the dpo forms (default {_bench_forms.DPO_SEQUENCE}): a pair longer "
        "than tile_pass's tile needs twice this above the tile",
    )  # fmt: skip
    p.add_argument(
        "--coupled-tile-mib", type=int, metavar="MIB",
        help="tile_pass's byte budget of a tile grown to hold a coupled group (default 256): scaled down "
        "with a small shape, pairs exceed it as 2 x 2048 tokens exceed the default at V=128256",
    )  # fmt: skip
    p.add_argument("--tile-tokens", type=int, help="tile_pass's tile in tokens (default: its own choice)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 exactness check")
    p.add_argument("--no-floor", action="store_true", help="skip the GEMM-floor measurement")
    p.add_argument("--sweep-tile", action="store_true", help="tile_pass at several tile_tokens too")
    p.add_argument("--tiles", type=_ints, help=f"tiles for --sweep-tile (default {SWEEP_TILES} up to N)")
    p.add_argument("--dynamic", action="store_true", help="dynamic=True over 8 lengths up to --tokens")
    p.add_argument("--warm-cache", action="store_true", help="keep Inductor's caches (compile_s not cold)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per measurement")
    p.add_argument("--json", help="write the rows (and machine info) to this file")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--host-overhead", action="store_true",
        help="host time per step at N=64 H=32 V=500 (1, 2, 4, 8 tiles) against plain aot_eager, one thread",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: measure, print the table, optionally write JSON."""
    args = _parse(argv)
    if args.host_overhead:
        rows = _bench_host.measure()
        print(_bench_host.format_rows(rows))
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"machine": machine_info(), "host_overhead": rows}, out, indent=1, default=str)
        return
    impls = args.impl.split(",") if args.impl else default_impls(args.device)
    if args.impl is None and (args.dynamic or args.sweep_tile):
        impls = ["inductor", "tile_pass"]
    dtypes = args.dtype.split(",")
    forms = args.form.split(",")
    if args.impl is None and any(form in _bench_forms.FORMS for form in forms):
        impls.insert(impls.index("tile_pass"), "chunked")
    for what, names, known in (("implementation", impls, IMPLS), ("form", forms, FORMS)):
        for name in names:
            if name not in known:
                raise SystemExit(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    machine = machine_info()
    result: dict[str, Any] = {
        "machine": machine,
        "argv": list(sys.argv[1:] if argv is None else argv),
        # the timing children's allocator (inherited from this process) and the peak step's
        "allocator": {"timing": allocator_env() or "glibc defaults", "peak": PEAK_ALLOCATOR},
        "load_before": os.getloadavg(),
    }

    def progress(row: dict[str, Any]) -> None:
        if not args.quiet:
            what = row.get("error") or f"{row.get('median_s', 0):.3f} s, {row.get('peak_mib') or 0:.0f} MiB"
            print(f"  {row['impl']:<13} {row.get('form', 'ce'):<8} N={row['tokens']} H={row['hidden']} "
                  f"V={row['vocab']} "
                  f"{row['dtype']}: {what}", file=sys.stderr, flush=True)  # fmt: skip

    if args.dynamic:
        lengths = dynamic_lengths(args.tokens[-1], args.hidden[0], args.vocab[0])
        rows = run_dynamic(
            impls, lengths, hidden=args.hidden[0], vocab=args.vocab[0], dtype=dtypes[0],
            device=args.device, timeout=args.timeout, warm_cache=args.warm_cache,
        )  # fmt: skip
        result["dynamic"] = rows
        print(table_caption(machine))
        print(format_dynamic(rows))
    else:
        if args.quick:
            shapes = QUICK
        elif args.full:
            shapes = FULL
        else:
            shapes = list(itertools.product(args.tokens, args.hidden, args.vocab, dtypes))
        tiles: list[int | None] = [args.tile_tokens]
        if args.sweep_tile:
            tiles += args.tiles or [t for t in SWEEP_TILES if t <= max(s[0] for s in shapes)]
        rows = run_benchmark(
            shapes, impls, device=args.device, repeats=args.repeats, check=not args.no_check,
            floor=not args.no_floor, tile_tokens=tiles, timeout=args.timeout,
            warm_cache=args.warm_cache, ignore_every=args.ignore_every, progress=progress, forms=forms,
            interleave=args.interleave, dpo_sequence=args.dpo_sequence,
            coupled_tile_mib=args.coupled_tile_mib,
        )  # fmt: skip
        result["rows"] = rows
        print(format_table(rows, markdown=args.markdown, machine=machine))
    result["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1, default=str)


def _config(raw: dict[str, Any]) -> BenchConfig:
    """A config from its JSON form (keys BenchConfig does not have are ignored)."""
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    return BenchConfig(**{k: v for k, v in raw.items() if k in fields})


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(run_child(_config(json.loads(sys.argv[2])))))
    elif len(sys.argv) > 3 and sys.argv[1] == "--child-interleaved":
        cfgs = [_config(raw) for raw in json.loads(sys.argv[3])]
        print(json.dumps(run_interleaved(cfgs, int(sys.argv[2]))))
    else:
        main()
