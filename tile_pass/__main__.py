"""The command line: ``python -m tile_pass explain path/to/script.py:function [--args SPEC] [--json]``.

``function`` is one of:

* a function of tensors, called with random ones built from ``--args`` (e.g.
  ``"float32[8,16,64] float32[1000,64] int64[8,16]<1000"``: dtype, shape, and for integer
  dtypes an exclusive upper bound);
* a factory: without ``--args`` it is called once eagerly and returns ``(fn, args)`` or
  ``(fn, args, kwargs)``, and ``fn`` is explained;
* a step: without ``--args`` it takes no arguments and computes the loss itself (returns
  anything but such a tuple); it is explained as it is, so it runs twice, once eagerly to
  tell it from a factory and once compiled.

A missing or malformed argument, a target that cannot be imported or called as given, and an
unreadable ``--args`` are usage errors (a message and exit status 2, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import torch

import tile_pass
from tile_pass._options import TileOptions

_ARG = re.compile(r"^(?P<dtype>\w+)\[(?P<shape>[\d,\s]*)\](?:<(?P<high>\d+))?$")

INNER_COMPILERS = ("inductor", "aot_eager", "eager")

_DESCRIPTION = "Compile a function with tile_pass and print what the pass rewrote or skipped, and why."

_EXPLAIN_DESCRIPTION = """\
Compile a function with tile_pass, call it once and print the report: each rewritten region
(its source lines, sizes, tile plan and the bytes it avoids) and each skipped one with the
reason.

TARGET is path/to/script.py:function or package.module:function. The function is one of:
  a function of tensors   called with random tensors built from --args;
  a factory               without --args: called once, returns (fn, args) or (fn, args, kwargs),
                          and fn is explained;
  a step                  without --args: takes no arguments and computes its own loss; it runs
                          twice (once eagerly, to tell it from a factory, then compiled).

--args is a space-separated list of dtype[shape], with an exclusive upper bound for integer
dtypes: "float32[8,128,64] float32[32000,64] int64[8,128]<32000". Floating tensors are
standard normal and require grad; integer ones are uniform in [0, bound) (bound 2 if absent).
"""

_EXAMPLES = """\
examples:
  python -m tile_pass explain train.py:loss_fn --args "float32[8,128,64] float32[32000,64] int64[8,128]<32000"
  python -m tile_pass explain train.py:make_step --json
  python -m tile_pass explain train.py:loss_fn --inner aot_eager --tile-tokens 256 \\
      --args "bfloat16[1024,64] bfloat16[32000,64] int64[1024]<32000"
"""


class UsageError(Exception):
    """A command-line argument that cannot be used; reported by ``parser.error`` (exit 2)."""


def parse_args_spec(spec: str) -> list[torch.Tensor]:
    """Random tensors from ``"float32[8,64] int64[8]<100"`` (floating ones require grad)."""
    tensors = []
    items = spec.split()
    if not items:
        raise UsageError('--args is empty; expected e.g. "float32[8,64] int64[8]<100"')
    for item in items:
        match = _ARG.match(item)
        if not match:
            raise UsageError(
                f"cannot read argument spec {item!r}; expected e.g. float32[8,64] or int64[8]<100"
            )
        dtype = getattr(torch, match["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"unknown dtype {match['dtype']!r} in {item!r}; e.g. float32, bfloat16, int64")
        shape = [int(s) for s in match["shape"].split(",") if s.strip()]
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, dtype=dtype).requires_grad_())
        elif dtype.is_complex or dtype == torch.bool:
            raise UsageError(f"{match['dtype']} in {item!r}: only floating and integer dtypes can be made")
        else:
            high = int(match["high"] or 2)
            if high < 1:
                raise UsageError(f"the bound in {item!r} must be at least 1")
            tensors.append(torch.randint(0, high, shape, dtype=dtype))
    return tensors


def load_target(target: str):
    """The callable ``target`` names (``path/to/script.py:function`` or ``package.module:function``)."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise UsageError(f"expected path/to/script.py:function or package.module:function, got {target!r}")
    if path.endswith(".py"):
        if not Path(path).is_file():
            raise UsageError(f"{path}: no such file")
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(path).resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the script's own code failed: say so, and how to see why
            raise UsageError(
                f"importing {path} raised {type(exc).__name__}: {exc} (run `python {path}` for the traceback)"
            ) from None
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise UsageError(f"cannot import module {path!r}: {exc}") from None
    try:
        found = getattr(module, name)
    except AttributeError:
        raise UsageError(f"{path} has no attribute {name!r}") from None
    if not callable(found):
        raise UsageError(f"{path}:{name} is not callable (its type is {type(found).__name__})")
    return found


def _is_factory_result(made) -> bool:
    """``(fn, args)`` or ``(fn, args, kwargs)``, as a factory returns."""
    return (
        isinstance(made, tuple)
        and len(made) in (2, 3)
        and callable(made[0])
        and isinstance(made[1], (tuple, list))
        and (len(made) == 2 or isinstance(made[2], dict))
    )


def _check_arity(target, name: str, count: int | None) -> None:
    """A usage error where ``target`` cannot take ``count`` positional arguments (``None``: no
    ``--args``, so none)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(*range(count or 0))
    except TypeError as why:
        if count is None:
            raise UsageError(
                f"{name}{signature} takes arguments: give them with --args (e.g. "
                '"float32[8,64] float32[100,64] int64[8]<100"), or name a factory or a zero-argument step'
            ) from None
        raise UsageError(
            f"--args gives {count} tensor(s), but {name}{signature} cannot take them: {why}"
        ) from None


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parser of ``python -m tile_pass`` and that of its ``explain`` command."""
    parser = argparse.ArgumentParser(
        prog="python -m tile_pass",
        description=_DESCRIPTION,
        epilog="Run 'python -m tile_pass explain --help' for the arguments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{explain}")
    explain = sub.add_parser(
        "explain",
        help="compile a function with tile_pass and print what was rewritten",
        description=_EXPLAIN_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument(
        "target", metavar="TARGET", help="path/to/script.py:function or package.module:function"
    )
    explain.add_argument(
        "--args", metavar="SPEC", help='random inputs, e.g. "float32[8,64] float32[100,64] int64[8]<100"'
    )
    explain.add_argument(
        "--inner",
        choices=INNER_COMPILERS,
        default="inductor",
        help="the compiler tile_pass hands the rewritten graph to (default inductor): the report is its plan",
    )
    explain.add_argument(
        "--tile-tokens", type=int, default=None, metavar="T", help="tokens per tile (default: automatic)"
    )
    explain.add_argument(
        "--drop-logits", action="store_true", help="do not compute logits that the function also returns"
    )
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser, explain


def main(argv: list[str] | None = None) -> int:
    parser, explain = build_parser()
    options = parser.parse_args(argv)
    try:  # checked where every entry point's options are: by building the one value
        tiling = TileOptions(tile_tokens=options.tile_tokens, drop_logits=options.drop_logits)
    except ValueError as why:
        explain.error(f"--{why}".replace("tile_tokens", "tile-tokens"))
    try:
        target = load_target(options.target)
        if options.args is not None:
            args = parse_args_spec(options.args)
            _check_arity(target, options.target, len(args))
        else:
            _check_arity(target, options.target, None)
    except UsageError as why:
        explain.error(str(why))
    if options.args is not None:
        fn, kwargs = target, {}
    else:
        made = target()
        if _is_factory_result(made):
            fn, args, kwargs = made[0], made[1], made[2] if len(made) == 3 else {}
        else:  # a zero-argument step that computes its own loss
            fn, args, kwargs = target, (), {}
    backend = tile_pass.backend(options.inner, tiling=tiling)
    report = backend.explain(fn, *args, **kwargs)
    print(report.to_json() if options.json else report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
