"""The pipeline table of docs/how_it_works.md, generated from the package tree.

    python scripts/pipeline_table.py            # print it
    python scripts/pipeline_table.py --write    # replace it between the markers in docs/how_it_works.md

Each phase folder says what it is in its ``__init__`` docstring and each module in its first
docstring line; the top-level modules are placed by :data:`TOP_LEVEL`. tests/test_layout.py fails when
the table in the docs is not this one, or when a module is in no row, so the table cannot go stale.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tile_pass"
DOC = PACKAGE.parent / "docs" / "how_it_works.md"
START, END = "<!-- pipeline table: scripts/pipeline_table.py --write -->", "<!-- end of pipeline table -->"

#: the rows in pipeline order: a phase folder (its modules listed), or a label and top-level modules
TOP_LEVEL: list[tuple[str, tuple[str, ...]]] = [
    (
        "entry points",
        (
            "dynamo_backend",
            "_compile",
            "_logging_calls",
            "decorator",
            "functional",
            "_textbook",
            "_options",
            "__main__",
        ),
    ),
    ("driver", ("rewrite",)),
    ("match", ()),
    ("program", ()),
    ("plan", ()),
    ("splice", ()),
    ("tiles", ()),
    ("distributed", ("_distributed",)),
    ("report and validation", ("report", "_rewrite_record", "validation")),
    ("inspection", ()),
    ("stacks", ("integrations",)),
    (
        "settings, caches, logging, measuring",
        ("_settings", "_caches", "_logging", "_measure", "bench", "_bench_forms", "_bench_host"),
    ),
]


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|")


def _entry(path: Path) -> str:
    """```name.py` (what its docstring says)``, or ```folder/` (...)`` from its ``__init__``."""
    if path.is_dir():
        return f"`{path.name}/` ({_first_line(path / '__init__.py')})"
    return f"`{path.name}` ({_first_line(path)})"


def rows() -> list[tuple[str, str]]:
    table = []
    for label, modules in TOP_LEVEL:
        folder = PACKAGE / label
        if not modules and folder.is_dir():
            members = sorted(p for p in folder.iterdir() if p.suffix == ".py" and p.name != "__init__.py")
            members += sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists())
            listed = ", ".join(_entry(p) for p in members)
            table.append((f"**{label}/**: {_first_line(folder / '__init__.py')}", listed))
        else:
            paths = [PACKAGE / m if (PACKAGE / m).is_dir() else PACKAGE / f"{m}.py" for m in modules]
            table.append((label, ", ".join(_entry(p) for p in paths)))
    return table


def unplaced() -> list[str]:
    """Top-level modules and folders of the package that no row names."""
    placed = {m for label, modules in TOP_LEVEL for m in (modules or (label,))}
    present = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    present |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return sorted(present - placed)


def table() -> str:
    lines = ["| phase | modules |", "|---|---|"]
    lines += [f"| {phase} | {modules} |" for phase, modules in rows()]
    return "\n".join(lines)


def in_docs() -> str:
    text = DOC.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def main(argv: list[str]) -> None:
    missing = unplaced()
    if missing:
        raise SystemExit(f"modules in no row of TOP_LEVEL: {', '.join(missing)}")
    if "--write" in argv:
        text = DOC.read_text()
        head, tail = text[: text.index(START) + len(START)], text[text.index(END) :]
        DOC.write_text(f"{head}\n{table()}\n{tail}")
    else:
        print(table())


if __name__ == "__main__":
    main(sys.argv[1:])
