"""``pip check`` for what this project installs, failing on any conflict but the accepted ones.

    python scripts/pip_check.py            # after pip install -e '.[test]' and torchtitan --no-deps

The project installs tile_pass with its ``test`` extra and torchtitan without its dependencies
(README, ``.ci/run``). Everything those pull in, transitively, is the project's: a conflict
that ``pip check`` reports for one of them fails this script unless :data:`ACCEPTED` lists it
with its reason. A package that none of them requires (installed by hand beside them) is not
the project's: its conflicts are printed and ignored. This is the one place the accepted
conflicts are listed; README.md and docs/usage.md point here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

#: what the project installs: tile_pass with these extras, and these packages (--no-deps);
#: the README's test command (.ci/run) installs the ``rl`` extra's packages with --no-deps
ROOTS = {"tile_pass": ("test", "rl"), "torchtitan": ()}

_RL = (
    "installed with --no-deps from the rl extra (the README's test command) for their loss modules alone "
    "(tests/test_rl_frameworks.py): their training requirements (ray, vllm, flash-attn, ...) do not "
    "install on a CPU machine, and their exact pins (transformers, deepspeed, tensordict) are not "
    "the test extra's; the loss modules the tests import run with what is installed"
)

#: (package, pattern that the ``pip check`` line matches, why it is accepted)
ACCEPTED = [
    (
        "torchtitan",
        r"has requirement datasets<4\.8\.0",
        "torchtitan 0.3.0 pins datasets<4.8, whose huggingface-hub<1 cannot meet transformers 5's "
        "huggingface-hub>=2.4; it is installed with --no-deps, and the parts the tests use "
        "(its models, losses and parallelisms: tests/test_torchtitan.py) run with datasets 5",
    ),
    ("verl", r"", _RL),
    ("openrlhf", r"", _RL),
]


def _listed(name: str, extras: tuple[str, ...]) -> list[str]:
    """``name``'s requirements as written: tile_pass's from this checkout's pyproject.toml (an
    editable install's metadata is as old as its last install), the others' as installed."""
    if canonicalize_name(name) == "tile-pass" and PYPROJECT.exists():
        try:
            import tomllib
        except ImportError:  # Python 3.10: the installed metadata
            pass
        else:
            project = tomllib.loads(PYPROJECT.read_text())["project"]
            optional = project.get("optional-dependencies", {})
            return list(project["dependencies"]) + [r for extra in extras for r in optional.get(extra, [])]
    try:
        return metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return []


def _requirements(name: str, extras: tuple[str, ...]) -> list[Requirement]:
    """``name``'s requirements that apply here, with ``extras`` asked for."""
    listed = _listed(name, extras)
    found = []
    for text in listed:
        requirement = Requirement(text)
        environments = [{"extra": extra} for extra in ("", *extras)]
        if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
            found.append(requirement)
    return found


def project_packages() -> set[str]:
    """The canonical names of the roots and everything they require, transitively, as installed."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(canonicalize_name(name), extras) for name, extras in ROOTS.items()]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo += [(canonicalize_name(r.name), tuple(sorted(r.extras))) for r in _requirements(*node)]
    return {name for name, _ in seen}


def _owner(line: str) -> str:
    """The package a ``pip check`` line is about (its first word)."""
    return canonicalize_name(line.split(" ", 1)[0])


def classify(lines: list[str], ours: set[str]) -> list[tuple[str, str, str]]:
    """Each ``pip check`` line as ``(verdict, line, why)``: ``"ignored"`` (no package the project
    installs), ``"accepted"`` (listed in :data:`ACCEPTED`) or ``"conflict"``."""
    verdicts = []
    for line in lines:
        owner = _owner(line)
        if owner not in ours:
            verdicts.append(
                ("ignored", line, f"nothing the project installs requires {line.split(' ', 1)[0]}")
            )
            continue
        why = next(
            (why for name, pattern, why in ACCEPTED if owner == name and re.search(pattern, line)), None
        )
        verdicts.append(("conflict", line, "") if why is None else ("accepted", line, why))
    return verdicts


def main() -> int:
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [
        line for line in check.stdout.splitlines() if line.strip() and "No broken requirements" not in line
    ]
    if check.returncode != 0 and not lines:
        print(check.stderr, file=sys.stderr)
        return check.returncode
    verdicts = classify(lines, project_packages())
    for verdict, line, why in verdicts:
        print(f"{verdict}: {line}" + (f"\n    why: {why}" if why else ""))
    failed = any(verdict == "conflict" for verdict, _, _ in verdicts)
    print(
        "pip check: "
        + ("a conflict above is not accepted (scripts/pip_check.py: ACCEPTED)" if failed else "ok")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
