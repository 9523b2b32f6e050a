"""``python -m tile_pass``: its help, its usage errors (exit 2, no traceback) and ``--inner``.

Most cases call ``tile_pass.__main__.main`` in this process (argparse's exit is a
``SystemExit``); one runs the module as a user does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tile_pass.__main__ import main

HEAD = (
    "import torch.nn.functional as F\n"
    "def head(h, w, y):\n"
    "    return F.cross_entropy(F.linear(h, w).float(), y)\n"
    "not_a_function = 3\n"
)
SPEC = "float32[32,16] float32[50,16] int64[32]<50"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(HEAD)
    return path


def _usage_error(capsys, argv) -> str:
    """The message of the usage error ``argv`` gives (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("usage: python -m tile_pass"), err
    return err.splitlines()[-1]


def test_help_is_plain_text_and_exits_zero(capsys):
    for argv in (["--help"], ["explain", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "``" not in out, out
        assert out.startswith("usage: python -m tile_pass")
    assert "--inner {inductor,aot_eager,eager}" in out
    # the description's own line breaks are kept (RawDescriptionHelpFormatter): a list, not a paragraph
    assert "\n  a factory " in out and "examples:\n  python -m tile_pass explain" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required"),
        (["explain"], "the following arguments are required: TARGET"),
        (["explain", "no_colon"], "expected path/to/script.py:function"),
        (["explain", "{dir}/missing.py:head"], "missing.py: no such file"),
        (["explain", "{dir}/train.py:nothere"], "has no attribute 'nothere'"),
        (["explain", "{dir}/train.py:not_a_function"], "is not callable"),
        (["explain", "{dir}/broken.py:head"], "importing {dir}/broken.py raised ModuleNotFoundError"),
        (["explain", "no_such_package.module:fn"], "cannot import module 'no_such_package.module'"),
        (["explain", "{dir}/train.py:head"], "takes arguments: give them with --args"),
        (["explain", "{dir}/train.py:head", "--args", "float32[32,16]"], "--args gives 1 tensor(s)"),
        (["explain", "{dir}/train.py:head", "--args", "float32[32,x]"], "cannot read argument spec"),
        (["explain", "{dir}/train.py:head", "--args", "floaty[2] a b"], "unknown dtype 'floaty'"),
        (["explain", "{dir}/train.py:head", "--args", " "], "--args is empty"),
        (["explain", "{dir}/train.py:head", "--args", SPEC, "--inner", "tvm"], "invalid choice: 'tvm'"),
        (["explain", "{dir}/train.py:head", "--args", SPEC, "--tile-tokens", "0"], "--tile-tokens must be"),
        (["explain", "{dir}/train.py:head", "--args", SPEC, "--tile-tokens", "x"], "invalid int value"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, script, argv, message):
    (script.parent / "broken.py").write_text("import no_such_module_anywhere\n")
    argv = [a.format(dir=script.parent) for a in argv]
    assert message.format(dir=script.parent) in _usage_error(capsys, argv)


@pytest.mark.parametrize("inner, compiled", [("inductor", True), ("aot_eager", False), ("eager", False)])
def test_inner_reaches_the_backend(capsys, script, inner, compiled):
    """The report is the plan of the named inner compiler: Inductor compiles the tiles (one
    [tile, V] buffer a tile), the others run them eagerly (several)."""
    assert main(["explain", f"{script}:head", "--args", SPEC, "--inner", inner, "--json"]) == 0
    (rewrite,) = json.loads(capsys.readouterr().out)["rewrites"]
    assert rewrite["compiled_tiles"] is compiled


def test_a_usage_error_from_the_command_line_exits_2_without_a_traceback(script):
    """The module as a user runs it (the other cases call its ``main``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tile_pass", "explain", f"{script}:head"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "takes arguments: give them with --args" in proc.stderr
