"""The README's code can't rot: its quick start runs as written, CI runs its test command, and
the links of the README and docs/ lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_the_quick_start_runs_as_written():
    """The first python block under "Quick start", in a fresh interpreter, as a user runs it."""
    pytest.importorskip("transformers")
    (code,) = _fenced(_section(README, "Quick start"), "python")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"^loss \d+\.\d{4}$", proc.stdout, flags=re.MULTILINE), proc.stdout
    assert "1 region(s) rewritten, 0 skipped" in proc.stdout, proc.stdout
    assert "graph break" not in proc.stdout, proc.stdout


def test_ci_runs_the_test_command_of_the_readme():
    """.ci/run calls the README's second set-up command exactly (update both together)."""
    (commands,) = _fenced(_section(README, "Set up: two commands"), "bash")
    install_and_test = [line for line in commands.splitlines() if line.strip() and not line.startswith("#")]
    assert len(install_and_test) == 2, commands
    assert "python examples/demo.py" in install_and_test[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test[1] in ci, (install_and_test[1], ci)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_extras_are_quoted_for_every_shell():
    """``pip install -e .[test]`` fails in zsh (a glob); ``'.[test]'`` works everywhere."""
    for path in [*_markdown_files(), ROOT / ".ci" / "run"]:
        bare = re.findall(r"pip install[^\n`]*?\s\.\[", path.read_text())
        assert not bare, (path.name, bare)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_lead_to_files_and_headings():
    for path in _markdown_files():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            assert linked.exists(), f"{path.name}: {target} does not exist"
            if anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
                assert anchor in {_anchor(h) for h in headings}, f"{path.name}: no heading for #{anchor}"
