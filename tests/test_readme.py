"""The README's code can't rot: its quick start runs as written, CI runs its test command, and
the links of the README and docs/ lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    """The first python block under "Quick start", in a fresh interpreter, as a user runs it, prints
    what the README says it prints: the seeded loss (on the torch release the README names) and
    every line of the report but the two that point into transformers' source."""
    pytest.importorskip("transformers")
    section = _section(README, "Quick start")
    (code,) = _fenced(section, "python")
    shown = _fenced(section, "text")[0].splitlines()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = proc.stdout.splitlines()
    assert re.fullmatch(r"loss \d+\.\d{4}", printed[0]), proc.stdout
    assert re.fullmatch(r"loss \d+\.\d{4}", shown[0]), shown[0]
    if torch.__version__.split("+")[0] == "2.13.0":  # the README's: "the loss is torch 2.13.0's"
        assert printed[0] == shown[0], (printed[0], shown[0])
    sourced = ("    matmul: ", "    loss:   ")
    assert [line for line in printed[1:] if not line.startswith(sourced)] == [
        line for line in shown[1:] if not line.startswith(sourced)
    ], proc.stdout
    assert [line.split(":", 1)[0] for line in printed if line.startswith(sourced)] == [
        line.split(":", 1)[0] for line in shown if line.startswith(sourced)
    ], proc.stdout
    assert "graph break" not in proc.stdout, proc.stdout


def test_usage_md_report_example_prints_what_it_shows():
    """docs/usage.md's "Seeing what tile_pass did": its explain block prints the report it quotes."""
    pytest.importorskip("transformers")
    section = _section((ROOT / "docs" / "usage.md").read_text(), "Seeing what tile_pass did")
    code, shown = _fenced(section, "python")[0], _fenced(section, "text")[0].splitlines()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sourced = ("    matmul: ", "    loss:   ")
    printed = proc.stdout.splitlines()
    assert [line for line in printed if not line.startswith(sourced)] == [
        line for line in shown if not line.startswith(sourced)
    ], proc.stdout
    assert (
        sum(line.startswith(sourced) for line in printed)
        == sum(line.startswith(sourced) for line in shown)
        == 2
    )


def test_ci_runs_the_test_command_of_the_readme():
    """.ci/run calls the README's second set-up command exactly (update both together)."""
    (commands,) = _fenced(_section(README, "Set up: two commands"), "bash")
    install_and_test = [line for line in commands.splitlines() if line.strip() and not line.startswith("#")]
    assert len(install_and_test) == 2, commands
    assert "python examples/demo.py" in install_and_test[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test[1] in ci, (install_and_test[1], ci)
    # what it installs with --no-deps beside torchtitan is the rl extra (tests/test_rl_frameworks.py)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    rl = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["rl"]
    no_deps = re.search(r"pip install --no-deps ([^&]+)&&", install_and_test[1]).group(1).split()
    assert no_deps == ["torchtitan==0.3.0", *rl], no_deps


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


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_examples_extra_installs_what_the_quick_start_imports():
    """The README's first command installs ``'.[examples]'`` for the quick start: every module
    the quick start imports, beside torch and tile_pass, must come with that extra."""
    (code,) = _fenced(_section(README, "Quick start"), "python")
    imported = set(re.findall(r"^(?:import|from) (\w+)", code, flags=re.MULTILINE)) - {"torch", "tile_pass"}
    extra = {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0] for requirement in _extras()["examples"]}
    assert imported and imported <= extra, (imported, extra)
    assert "pip install -e '.[examples]'" in _fenced(_section(README, "Set up: two commands"), "bash")[0]


def test_pip_check_fails_on_a_conflict_of_the_projects_and_only_there():
    """scripts/pip_check.py: the accepted conflicts pass with their reason, a new conflict of a
    package the project installs fails, one of a package installed beside it by hand is ignored."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import pip_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    ours = {"torchtitan", "peft"}
    lines = [
        "torchtitan 0.3.0 has requirement datasets<4.8.0,>=3.6.0, but you have datasets 5.2.0.",
        "torchtitan 0.3.0 requires wandb, which is not installed.",
        "peft 0.21.2 has requirement torch>=3, but you have torch 2.13.0.",
        "verl 0.9.1 requires ray, which is not installed.",
    ]
    verdicts = [verdict for verdict, _, _ in pip_check.classify(lines, ours)]
    assert verdicts == ["accepted", "conflict", "conflict", "ignored"]
    assert all(why for _, _, why in pip_check.ACCEPTED)
