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


@dataclass(frozen=True)
class Settings:
    cpu_gemm: str  # "onednn" or "aten"


def _default_cpu_gemm() -> str:
    return "onednn" if platform.machine().lower() in ("x86_64", "amd64") else "aten"


def _read() -> Settings:
    cpu_gemm = os.environ.get(CPU_GEMM_ENV, "").strip().lower() or _default_cpu_gemm()
    if cpu_gemm not in _CPU_GEMMS:
        raise ValueError(
            f"{CPU_GEMM_ENV}={cpu_gemm!r}: expected 'onednn' (the default on x86-64) or 'aten'; "
            f"unset it or set it to one of those"
        )
    return Settings(cpu_gemm=cpu_gemm)


_current = _read()


def current() -> Settings:
    """The settings in force (read at import, or at the last :func:`reload`)."""
    return _current


def reload() -> Settings:
    """Read the environment again; raises on a bad value, keeping the previous settings."""
    global _current
    _current = _read()
    return _current
