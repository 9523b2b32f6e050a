"""``python -m tile_pass explain path/to/script.py:function [--args SPEC] [--json]``.

``function`` is one of:

* a function of tensors, called with random ones built from ``--args`` (e.g.
  ``"float32[8,16,64] float32[1000,64] int64[8,16]<1000"``: dtype, shape, and for integer
  dtypes an exclusive upper bound);
* a factory: without ``--args`` it is called once eagerly and returns ``(fn, args)`` or
  ``(fn, args, kwargs)``, and ``fn`` is explained;
* a step: without ``--args`` it takes no arguments and computes the loss itself (returns
  anything but such a tuple); it is explained as it is, so it runs twice, once eagerly to
  tell it from a factory and once compiled.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import torch

import tile_pass

_ARG = re.compile(r"^(?P<dtype>\w+)\[(?P<shape>[\d,\s]*)\](?:<(?P<high>\d+))?$")


def parse_args_spec(spec: str) -> list[torch.Tensor]:
    """Random tensors from ``"float32[8,64] int64[8]<100"`` (floating ones require grad)."""
    tensors = []
    for item in spec.split():
        match = _ARG.match(item)
        if not match:
            raise SystemExit(
                f"cannot read argument spec {item!r}; expected e.g. float32[8,64] or int64[8]<100"
            )
        dtype = getattr(torch, match["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"unknown dtype {match['dtype']!r} in {item!r}")
        shape = [int(s) for s in match["shape"].split(",") if s.strip()]
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, dtype=dtype).requires_grad_())
        else:
            tensors.append(torch.randint(0, int(match["high"] or 2), shape, dtype=dtype))
    return tensors


def load_target(target: str):
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise SystemExit(f"expected path/to/script.py:function or package.module:function, got {target!r}")
    if path.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(path).resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    try:
        return getattr(module, name)
    except AttributeError:
        raise SystemExit(f"{path} has no attribute {name!r}") from None


def _is_factory_result(made) -> bool:
    """``(fn, args)`` or ``(fn, args, kwargs)``, as a factory returns."""
    return (
        isinstance(made, tuple)
        and len(made) in (2, 3)
        and callable(made[0])
        and isinstance(made[1], (tuple, list))
        and (len(made) == 2 or isinstance(made[2], dict))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tile_pass", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="compile a function with tile_pass and print what was rewritten")
    explain.add_argument("target", help="path/to/script.py:function or package.module:function")
    explain.add_argument("--args", help='random inputs, e.g. "float32[8,64] float32[100,64] int64[8]<100"')
    explain.add_argument("--tile-tokens", type=int, default=None)
    explain.add_argument("--drop-logits", action="store_true")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    options = parser.parse_args(argv)

    target = load_target(options.target)
    if options.args is not None:
        fn, args, kwargs = target, parse_args_spec(options.args), {}
    else:
        made = target()
        if _is_factory_result(made):
            fn, args, kwargs = made[0], made[1], made[2] if len(made) == 3 else {}
        else:  # a zero-argument step that computes its own loss
            fn, args, kwargs = target, (), {}
    backend = tile_pass.backend(tile_tokens=options.tile_tokens, drop_logits=options.drop_logits)
    report = backend.explain(fn, *args, **kwargs)
    print(report.to_json() if options.json else report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
