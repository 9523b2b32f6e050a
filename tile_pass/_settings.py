"""Settings from the environment, read once when tile_pass is imported.

A bad value fails at import, naming the variable and its accepted values, rather than in
the middle of a training step. :func:`reload` reads them again (for tests and notebooks
that change the environment after import).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

#: ``TILE_PASS_CPU_GEMM=aten`` keeps every tile GEMM on aten's own CPU GEMM (MKL on x86);
#: ``onednn`` routes the float32 ones to oneDNN, the default on x86-64, where it was measured.
CPU_GEMM_ENV = "TILE_PASS_CPU_GEMM"
_CPU_GEMMS = ("onednn", "aten")
#: ``TILE_PASS_WEIGHT_GRAD_SUM=float32`` keeps the half-precision weight-gradient sum as one
#: float32 tensor (6 bytes per weight at the end of the loop); ``split`` (the default for
#: 16-bit weights) holds the same float32 sum in two 16-bit planes (4); see _weight_grad.
WEIGHT_GRAD_SUM_ENV = "TILE_PASS_WEIGHT_GRAD_SUM"
_WEIGHT_GRAD_SUMS = ("auto", "split", "float32")
#: ``TILE_PASS_HUGE_PAGES=off`` leaves tile_pass's large CPU buffers on the system's default
#: pages; ``on`` (the default) asks Linux for transparent huge pages on them (see _tile_buffers).
HUGE_PAGES_ENV = "TILE_PASS_HUGE_PAGES"
_HUGE_PAGES = ("on", "off")
#: ``TILE_PASS_STRICT=1`` makes an internal error of the pass raise (``tile_pass.backend(strict=True)``
#: per backend); by default the graph is left as Dynamo gave it and the error is logged and reported.
STRICT_ENV = "TILE_PASS_STRICT"
_STRICT = {"0": False, "off": False, "false": False, "1": True, "on": True, "true": True}


@dataclass(frozen=True)
class Settings:
    cpu_gemm: str  # "onednn" or "aten"
    weight_grad_sum: str = "auto"  # "auto", "split" or "float32"
    huge_pages: bool = True
    strict: bool = False


def _default_cpu_gemm() -> str:
    return "onednn" if platform.machine().lower() in ("x86_64", "amd64") else "aten"


def _choice(env: str, default: str, accepted, expected: str) -> str:
    """``env``'s value, lower-cased (``default`` where unset or empty), which must be in ``accepted``."""
    value = os.environ.get(env, "").strip().lower() or default
    if value not in accepted:
        raise ValueError(f"{env}={value!r}: expected {expected}; unset it or set it to one of those")
    return value


def _read() -> Settings:
    cpu_gemm = _choice(
        CPU_GEMM_ENV, _default_cpu_gemm(), _CPU_GEMMS, "'onednn' (the default on x86-64) or 'aten'"
    )
    weight_grad_sum = _choice(WEIGHT_GRAD_SUM_ENV, "auto", _WEIGHT_GRAD_SUMS, f"one of {_WEIGHT_GRAD_SUMS}")
    huge_pages = _choice(HUGE_PAGES_ENV, "on", _HUGE_PAGES, "'on' (the default) or 'off'")
    strict = _choice(STRICT_ENV, "0", _STRICT, "1 or 0")
    return Settings(
        cpu_gemm=cpu_gemm,
        weight_grad_sum=weight_grad_sum,
        huge_pages=huge_pages == "on",
        strict=_STRICT[strict],
    )


_current = _read()


def current() -> Settings:
    """The settings in force (read at import, or at the last :func:`reload`)."""
    return _current


def reload() -> Settings:
    """Read the environment again; raises on a bad value, keeping the previous settings."""
    global _current
    _current = _read()
    return _current
