"""The rewritten graphs, where a person or a tool can look at them.

* A dump folder (``tile_pass.backend(dump_dir=...)`` or ``TILE_PASS_DUMP_DIR``): per graph,
  ``graph_<i>_before.py`` and ``graph_<i>_after.py`` (readable Python with the user's source
  line as a comment above each node), ``graph_<i>_report.json``, and, where pydot and
  graphviz are installed, ``graph_<i>_before.svg`` / ``_after.svg`` drawings.
* Structured compile artifacts (``torch._logging.trace_structured``), so ``tlparse`` shows
  the same before/after code and the decisions beside Dynamo's and Inductor's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.fx
from torch._logging._internal import trace_log

from tile_pass._logging import log
from tile_pass.report import GraphReport


def readable(gm: torch.fx.GraphModule) -> str:
    """``GraphModule.code`` with shapes and the original source line beside each node."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def structured_tracing_enabled() -> bool:
    return bool(trace_log.handlers)


def dump_dir_from_env() -> str | None:
    return os.environ.get("TILE_PASS_DUMP_DIR") or None


def emit(
    gm_after: torch.fx.GraphModule, before: str | None, report: GraphReport, dump_dir: str | None
) -> None:
    """Write the before/after views of one graph to ``dump_dir`` and the structured trace."""
    after = readable(gm_after) if (dump_dir or structured_tracing_enabled()) else None
    decisions = {
        "rewrites": [dataclasses.asdict(r) for r in report.rewrites],
        "skipped": [dataclasses.asdict(s) for s in report.skipped],
    }
    if structured_tracing_enabled():
        artifacts = [("graph_before", "string", before), ("graph_after", "string", after)]
        for name, encoding, payload in [*artifacts, ("decisions", "json", json.dumps(decisions))]:
            if payload is not None:
                metadata = {"name": f"tile_pass_{name}", "encoding": encoding}
                torch._logging.trace_structured(
                    "artifact", metadata_fn=lambda m=metadata: m, payload_fn=lambda p=payload: p
                )
    if not dump_dir:
        return
    folder = Path(dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"graph_{report.index}"
    if before is not None:
        (folder / f"{stem}_before.py").write_text(before)
    (folder / f"{stem}_after.py").write_text(after)
    (folder / f"{stem}_report.json").write_text(json.dumps(decisions, indent=2))
    _draw(gm_after, folder / f"{stem}_after.svg")
    log.info("tile_pass: wrote graph %d views to %s", report.index, folder)


def draw_before(gm: torch.fx.GraphModule, dump_dir: str, index: int) -> None:
    _draw(gm, Path(dump_dir) / f"graph_{index}_before.svg")


def _draw(gm: torch.fx.GraphModule, path: Path) -> None:
    """An SVG drawing of the graph, when the optional pydot/graphviz are installed."""
    try:
        from torch.fx.passes.graph_drawer import FxGraphDrawer

        path.parent.mkdir(parents=True, exist_ok=True)
        drawer = FxGraphDrawer(gm, path.stem, ignore_getattr=True)
        drawer.get_main_dot_graph().write_svg(str(path))
    except Exception as err:  # optional: pydot or the graphviz binary missing
        log.debug("tile_pass: no drawing of %s (%s)", path.name, err)
