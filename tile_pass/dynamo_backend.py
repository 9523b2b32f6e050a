"""The torch.compile backend: rewrite the Dynamo graph, then hand it to an inner compiler."""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from tile_pass._logging import log
from tile_pass._options import TileOptions, tile_options
from tile_pass.inspection import _dump
from tile_pass.inspection._oracle import validating_call
from tile_pass.report import GraphReport, Report, graph_break_hint
from tile_pass.rewrite import (
    GRAPH_BREAK,
    LEFT_WHOLE,
    internal_error,
    is_region_node,
    programs_called,
    rewrite_graph,
)
from tile_pass.splice._returned_logits import rebuild_outputs
from tile_pass.tiles._higher_order import guard_outputs, outputs_guarded, region_outputs

CompilerFn = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable]
_INNER_NAMES = ("inductor", "aot_eager", "eager")
#: the backend's own keywords beside the tiling's (named in the error for an unknown one)
_SETTINGS = ("inner", "dump_dir", "validate", "mode", "options", "keep_reports")


def _resolve_inner(
    inner: str | CompilerFn, mode: str | None = None, options: dict[str, Any] | None = None
) -> CompilerFn:
    """The inner compiler; ``mode`` and ``options`` configure Inductor exactly as
    ``torch.compile(mode=..., options=...)`` would (and are validated the same way)."""
    if not callable(inner) and inner not in _INNER_NAMES:
        raise ValueError(
            f"inner must be one of {_INNER_NAMES} or a torch.compile backend callable, got {inner!r}"
        )
    configured = (mode is not None and mode != "default") or bool(options)
    if configured and inner != "inductor":
        what = "a backend callable" if callable(inner) else f"inner={inner!r}"
        raise ValueError(
            f"mode={mode!r} / options={options!r} configure Inductor, but the rewritten graph is compiled "
            f"by {what}, which takes neither. Use inner='inductor', or drop mode/options (configure your "
            "own backend callable itself)."
        )
    if callable(inner):
        return inner
    if inner == "eager":
        return lambda gm, example_inputs: gm.forward
    if configured:
        return torch._TorchCompileInductorWrapper(mode, options, None)
    return torch._dynamo.lookup_backend(inner)


class Backend:
    """A configured tile_pass backend: ``torch.compile(model, backend=tile_pass.Backend(...))``
    (``tile_pass.backend(...)`` builds the same).

    How it tiles is one :class:`~tile_pass.TileOptions`: ``tiling=``, or its fields as keywords
    (``Backend("aot_eager", tile_tokens=256)``; both: the keywords replace those fields). Its
    ``compile_tiles`` and ``strict`` are decided for ``inner`` (:meth:`TileOptions.resolved`);
    ``.tiling`` is the result.

    The backend's own settings: ``inner`` compiles the rewritten graph: ``"inductor"`` (default),
    ``"aot_eager"``, ``"eager"`` or any backend callable. ``dump_dir`` (or the
    ``TILE_PASS_DUMP_DIR`` environment variable) receives each graph before and after the rewrite
    as readable Python and, where graphviz is installed, SVG. ``validate=True`` checks each
    rewritten graph on its first call against the original graph run eagerly in float64 (outputs
    and gradients) and raises on disagreement. ``mode`` and ``options`` configure the inner
    Inductor as ``torch.compile(mode=..., options=...)`` would (``"max-autotune"``,
    ``"reduce-overhead"``, ``{"max_autotune": True}``); they raise for any other inner compiler.
    They apply to the rewritten graph; the tiles' elementwise middle keeps Inductor's defaults (it
    holds no GEMM for max-autotune to tune: the tiles' GEMMs are library calls). ``reports`` keeps
    the decisions for the last ``keep_reports`` graphs it compiled (at least one).

    The pass never ends a run unless ``strict``: an internal error leaves the graph as Dynamo gave
    it and is reported as a skip ("internal error: ...").
    """

    def __init__(
        self,
        inner: str | CompilerFn = "inductor",
        *,
        tiling: TileOptions | None = None,
        dump_dir: str | None = None,
        validate: bool = False,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        keep_reports: int = 64,
        **tile_fields: Any,
    ):
        self.inner = inner
        self.dump_dir = dump_dir
        self.validate = validate
        self.mode = mode
        self.options = dict(options) if options else None
        self.tiling = tile_options("tile_pass.Backend", tiling, tile_fields, _SETTINGS).resolved(inner)
        self._inner = _resolve_inner(inner, mode, self.options)
        self._graphs_seen = 0
        self._warned_eager_raises: set[str] = set()  # warn once per skipped region and reason
        self._last_break: str | None = None  # where Dynamo broke the graph it handed us last, and why
        self._breaks_then: list[str] = []  # Dynamo's graph-break reasons counted up to that graph
        self.reports: collections.deque[GraphReport] = collections.deque(maxlen=max(1, keep_reports))

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable:
        """Rewrite ``gm`` and compile it with the inner compiler. ``mode`` and ``options`` are
        what ``torch.compile(..., mode=..., options=...)`` hands a backend; they configure
        the inner Inductor on top of this backend's own (torch.compile's win)."""
        inner_compiler = self._inner
        if (mode is not None and mode != "default") or options:
            inner_compiler = _resolve_inner(
                self.inner,
                mode if mode is not None else self.mode,
                {**(self.options or {}), **(options or {})},
            )
        dump_dir = self.dump_dir or _dump.dump_dir_from_env()
        before = _dump.readable(gm) if dump_dir or _dump.structured_tracing_enabled() else None
        if dump_dir:
            _dump.draw_before(gm, dump_dir, self._graphs_seen)
        original = copy.deepcopy(gm) if self.validate else None
        result = rewrite_graph(gm, self.tiling, graph_index=self._graphs_seen)
        report = result.report
        self._name_graph_breaks(report)
        self._graphs_seen += 1
        self.reports.append(report)
        for decision in [*report.rewrites, *report.skipped]:
            log.info("%s", decision)
        _warn_eager_raises(self, report)
        if report.rewrites:
            log.debug("rewritten graph %d:\n%s", report.index, gm.code)
        _dump.emit(gm, before, report, dump_dir)
        try:
            with outputs_guarded():
                compiled = inner_compiler(gm, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:  # Dynamo traces the frame again and calls back
            self.reports.remove(report)
            self._graphs_seen -= 1
            raise
        except Exception as error:
            if self.strict or not report.rewrites:
                raise
            # the rewritten graph does not compile: the pass must not be why the run dies
            lines = "; ".join(f"{r.matmul_source}; {r.loss_source}" for r in report.rewrites)
            log.warning("tile_pass: the rewritten graph %d failed to compile; compiling it as Dynamo gave it",
                        report.index, exc_info=True)  # fmt: skip
            gm.graph = result.original_graph
            gm.recompile()
            report.rewrites.clear()
            report.skipped.append(internal_error(report.index, lines, error))
            return _holding(inner_compiler(gm, example_inputs), programs_called(gm.graph))
        return _holding(_wrapped(compiled, gm, result, original), programs_called(gm.graph))

    def _name_graph_breaks(self, report: GraphReport) -> None:
        """A skip whose logits came from the graph before a break names that break; a head left whole
        names the break that ends this graph."""
        breaks = _new_dynamo_breaks()
        here = _graph_break_here()
        for skip in report.skipped:
            if skip.reason == GRAPH_BREAK and self._last_break is not None:
                skip.reason = f"{GRAPH_BREAK}. {_named_break(self._last_break, self._breaks_then + breaks)}"
            elif LEFT_WHOLE in skip.reason and here is not None:
                after = _named_break(here, breaks).replace("broke the graph before it", "ended this graph")
                skip.reason = f"{skip.reason}. {after}"
        self._last_break = here
        self._breaks_then = breaks

    def report(self) -> Report:
        """The decisions on every graph this backend compiled (up to ``keep_reports``)."""
        return Report(list(self.reports))

    def explain(self, fn: Callable, *args: Any, **kwargs: Any) -> Report:
        """Compile ``fn`` with this backend's options, call it once, and report the decisions.

        The report is this backend's plan: the same tile sizes, the same handling of returned
        logits. To be quick, the call runs the rewritten forward with the inner compiler
        ``eager`` and uncompiled tiles of those sizes.
        """
        planned = dataclasses.replace(self.tiling, run_compiled_tiles=False)
        recorder = Backend("eager", tiling=planned, dump_dir=self.dump_dir, keep_reports=1024)
        breaks_before = collections.Counter(torch._dynamo.utils.counters["graph_break"])
        eager_error = ""
        try:
            torch.compile(fn, backend=recorder)(*args, **kwargs)
        except Exception as error:  # eager's own error on an input the pass refused for it: report it
            if not any(skip.eager_raises for skip in recorder.report().skipped):
                raise
            eager_error = f"{type(error).__name__}: {_first_line(error)}"
        report = recorder.report()
        report.eager_error = eager_error
        new_breaks = torch._dynamo.utils.counters["graph_break"] - breaks_before
        report.graph_breaks = [_summarise_break(reason) for reason in new_breaks]
        return report

    @property
    def compile_tiles(self) -> bool:
        return self.tiling.compile_tiles

    @property
    def strict(self) -> bool:
        return self.tiling.strict

    def __repr__(self) -> str:
        return (
            f"tile_pass.backend(inner={self.inner!r}, tiling={self.tiling!r}, dump_dir={self.dump_dir!r}, "
            f"validate={self.validate}"
            + (f", mode={self.mode!r}" if self.mode else "")
            + (f", options={self.options!r}" if self.options else "")
            + ")"
        )


#: Dynamo's graph-break reasons counted when a tile_pass backend was last handed a graph
_breaks_seen: collections.Counter = collections.Counter(torch._dynamo.utils.counters["graph_break"])


def _new_dynamo_breaks() -> list[str]:
    """Dynamo's graph-break reasons counted since a tile_pass backend was last handed a graph
    (Dynamo counts the break that ends a graph before or after it hands that graph over)."""
    global _breaks_seen
    now = collections.Counter(torch._dynamo.utils.counters["graph_break"])
    if now.total() < _breaks_seen.total():  # the counters were cleared since (torch._dynamo.reset())
        _breaks_seen = collections.Counter()
    new, _breaks_seen = list(now - _breaks_seen), now
    return new


def _graph_break_here() -> str | None:
    """Where and why Dynamo ended the graph it is handing the backend, if a graph break did:
    the next graph starts after it, so a loss there whose logits are an input names this."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
    except Exception:  # not inside Dynamo (a direct call), or another torch's internals
        return None
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    where = "?"
    if reason.user_stack:
        frame = reason.user_stack[-1]
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    text = f"Dynamo broke the graph before it at {where}: {reason.reason.strip().splitlines()[0]}"
    hint = graph_break_hint(reason.reason)
    return f"{text}; fix: {hint}" if hint else text


def _named_break(where: str, breaks: list[str]) -> str:
    """``where`` Dynamo broke the graph, with the call that broke it and its fix, from the breaks
    Dynamo counted around it, where its reason there names neither (a break inside a called
    function: "step_unsupported" at the call's line)."""
    if "; fix: " in where:
        return where
    known = [reason for reason in breaks if graph_break_hint(reason)]
    if not known:
        return where
    return f"{where} ({_summarise_break(known[-1])}); fix: {graph_break_hint(known[-1])}"


def _summarise_break(reason: str) -> str:
    """The first line of Dynamo's reason, and the call it refers to when it names one."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    summary = lines[0] if lines else reason
    context = next((line for line in lines if line.startswith("Developer debug context")), "")
    return f"{summary} ({context.removeprefix('Developer debug context: ')[:300]})" if context else summary


def backend(inner: str | CompilerFn = "inductor", **settings: Any) -> Backend:
    """A configured backend: ``torch.compile(model, backend=tile_pass.backend(...))``.

    The same as :class:`Backend` (``inner``, ``tiling=`` or :class:`~tile_pass.TileOptions`'s
    fields as keywords, ``dump_dir``, ``validate``, ``mode``, ``options``, ``keep_reports``; each
    is documented there, the tiling fields on :class:`~tile_pass.TileOptions`):
    ``tile_pass.backend("aot_eager", tile_tokens=256, drop_logits=True)``.
    """
    return Backend(inner, **settings)


def _holding(compiled: Callable, programs: tuple) -> Callable:
    """``compiled``, holding the programs its region calls run, which it names by key only: the
    program registry forgets a program nothing holds (see :func:`tile_pass.rewrite.programs_called`)."""
    if not programs:
        return compiled
    try:
        compiled.tile_pass_programs = (*getattr(compiled, "tile_pass_programs", ()), *programs)
        return compiled
    except AttributeError:  # a bound method (the inner compiler "eager"): a function holds them

        def run(*args):
            return compiled(*args)

        run.tile_pass_programs = programs
        return run


def _with_rebuilt_outputs(compiled: Callable, num_outputs: int, records) -> Callable:
    """Wrap a compiled graph so it returns the original outputs (see _returned_logits)."""

    def run(*args):
        return rebuild_outputs(compiled(*args), num_outputs, records)

    return run


_default_backend: Backend | None = None


def default_backend() -> Backend:
    """The backend behind ``backend="tile_pass"``; its ``report()`` shows what it did."""
    global _default_backend
    if _default_backend is None:
        _default_backend = Backend()
    return _default_backend


def tile_pass_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **compile_options: Any
) -> Callable:
    """``backend="tile_pass"``: the default configuration, inner compiler inductor;
    ``torch.compile``'s ``mode=`` and ``options=`` reach that Inductor."""
    return default_backend()(gm, example_inputs, **compile_options)


def _warn_eager_raises(backend: Backend, report: GraphReport) -> None:
    """A region skipped because eager raises on its input runs as the inner compiler makes it:
    eager and aot_eager raise eager's error at the step, but Inductor may return a value (an
    int32 target's loss) where eager refuses, which the step alone would never show."""
    if backend.inner in ("eager", "aot_eager"):
        return
    for skip in report.skipped:
        key = f"{skip.loss_source}: {skip.reason}"
        if skip.eager_raises and key not in backend._warned_eager_raises:
            backend._warned_eager_raises.add(key)
            log.warning(
                "tile_pass: eager raises on this input, so the region at %s was left as Dynamo gave it and "
                "the inner compiler runs it as it is (Inductor may return a value where eager raises): %s",
                skip.loss_source, skip.reason,
            )  # fmt: skip


def _first_line(error: BaseException) -> str:
    """An error's message without Dynamo's appended context (user stack, hints)."""
    return str(error).strip().split("\n", 1)[0]


def explain(fn: Callable, *args: Any, tiling: TileOptions | None = None, **kwargs: Any) -> Report:
    """Compile ``fn`` with tile_pass, call it once with ``args`` and ``kwargs``, and report what was
    rewritten: the plan of ``backend="tile_pass"`` (inductor, compiled tiles), or of
    ``tile_pass.backend(tiling=tiling)`` where ``tiling`` (a :class:`~tile_pass.TileOptions`) is
    given. (Every other keyword is ``fn``'s, so the tiling's fields are not taken one by one here;
    ``tile_pass.backend(inner, ...).explain(fn, ...)`` explains any configured backend.)"""
    planner = default_backend() if tiling is None else Backend(tiling=tiling)
    return planner.explain(fn, *args, **kwargs)


def _wrapped(compiled: Callable, gm: torch.fx.GraphModule, result, original) -> Callable:
    """The compiled graph as the caller must see it: returned logits rebuilt from the tiles, a second
    derivative through a region raising where it is requested (see ``_higher_order``), and, with
    ``validate=True``, each call checked against the graph Dynamo gave."""
    report = result.report
    first_order = region_outputs(gm, is_region_node)
    if result.returned_logits:
        rebuilt = {record.output_index for record in result.returned_logits}
        compiled = _with_rebuilt_outputs(compiled, result.num_outputs, result.returned_logits)
        first_order = [i for i in first_order if i < result.num_outputs and i not in rebuilt]
    if first_order:
        compiled = guard_outputs(compiled, first_order)
    if original is not None and report.rewrites:
        num_outputs = result.num_outputs or len(gm.graph.output_node().args[0])
        compiled = validating_call(
            original, compiled, num_outputs, on_result=lambda outcome: setattr(report, "validation", outcome)
        )
    return compiled
