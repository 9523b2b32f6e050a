"""The ``tile_pass`` logger, part of torch logging: ``TORCH_LOGS="+tile_pass"``.

No handler set-up is needed here: when ``TORCH_LOGS`` names ``tile_pass``, torch's own log
initialisation imports this package as a module logger and attaches its handler.
``torch._logging.set_logs(modules={"tile_pass": logging.INFO})`` works in-process.
"""

from __future__ import annotations

import logging

import torch._logging._internal as _torch_logging

log = logging.getLogger("tile_pass")

_torch_logging.register_log("tile_pass", "tile_pass")
