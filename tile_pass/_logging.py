"""The ``tile_pass`` logger, registered with torch logging: ``TORCH_LOGS="+tile_pass"``."""

from __future__ import annotations

import logging
import os

import torch._logging._internal as _torch_logging

log = logging.getLogger("tile_pass")

_torch_logging.register_log("tile_pass", "tile_pass")
if "tile_pass" in os.environ.get("TORCH_LOGS", ""):
    # TORCH_LOGS was parsed when torch was imported, before this log existed.
    _torch_logging._init_logs()
