"""OpenRLHF: its log-prob helper ends the compiled graph between the head and the log-softmax.

OpenRLHF's ``Actor.forward`` (0.11) computes the float32 logits, divides them by the
temperature in place, takes ``compute_entropy`` of them and then
``openrlhf.models.utils.log_probs_from_logits(logits, rolled_sequences)``. That helper tries
``from flash_attn.ops.triton.cross_entropy import cross_entropy_loss`` inside the function, in a
``try`` block. Without flash-attn (any CPU machine) the failing import is a graph break under
``torch.compile``: the head's graph returns the whole ``[N, V]`` logits and the log-softmax runs
in another graph that receives them as an input, so tile_pass cannot tile the log-probabilities.
With flash-attn, the helper runs flash-attn's Triton cross entropy, which tile_pass does not see
into.

:func:`hand_log_probs_to_tile_pass` (one line, after importing OpenRLHF and before compiling
the actor's forward with ``backend="tile_pass"``) puts :func:`log_probs_from_logits` in its
place in every loaded OpenRLHF module that holds the helper: the same contract and values
(``logits`` gathered at the labels minus their ``logsumexp``, after the optional in-place
division by ``temperature``), written in plain torch ops with no import inside, so the head,
the entropy and the log-probabilities stay in one graph and are tiled together
(``tests/test_rl_frameworks.py``: OpenRLHF's PPO, GSPO and DPO steps through its own
functions, rewritten and exact). :func:`restore_log_probs` puts OpenRLHF's helper back.

Not tested here: OpenRLHF's ``Actor`` itself (its module imports flash-attn at import time, so
it does not import on a machine without CUDA), sample packing and ring attention.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tile_pass._logging import log

#: where OpenRLHF defines the helper; modules that import it by name hold their own reference
_HOME = "openrlhf.models.utils"
#: (module, OpenRLHF's helper) for each module patched, so that it can be put back
_patched: list[tuple[object, object]] = []


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """OpenRLHF's ``log_probs_from_logits`` without its in-function import: the graph stays
    whole, so the log-softmax is found next to the head. The temperature divides ``logits`` in
    place, as OpenRLHF's does (callers read the divided logits afterwards)."""
    if temperature != 1.0:
        logits.div_(temperature)
    index = labels.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return torch.gather(logits, -1, index).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # half precision: OpenRLHF takes log_softmax in the logits' dtype (row by row, the same values)
    return F.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1)


def hand_log_probs_to_tile_pass() -> list[str]:
    """Replace OpenRLHF's ``log_probs_from_logits`` in ``openrlhf.models.utils`` and in every
    loaded ``openrlhf`` module that imported it by name (``openrlhf.models.actor``); returns
    those modules' names. Imports ``openrlhf.models.utils`` if it is not loaded yet (a module
    imported later takes the replacement from there). Calling it twice changes nothing."""
    if _HOME not in sys.modules:
        import importlib

        importlib.import_module(_HOME)
    original = getattr(sys.modules[_HOME], "log_probs_from_logits", None)
    if original is log_probs_from_logits:
        return [name for name, module in _loaded() if module.log_probs_from_logits is log_probs_from_logits]
    names = []
    for name, module in _loaded():
        if getattr(module, "log_probs_from_logits", None) is original:
            _patched.append((module, original))
            module.log_probs_from_logits = log_probs_from_logits
            names.append(name)
    log.info("tile_pass: OpenRLHF's log_probs_from_logits replaced in %s", ", ".join(names))
    return names


def restore_log_probs() -> None:
    """Put OpenRLHF's own ``log_probs_from_logits`` back where it was replaced."""
    while _patched:
        module, original = _patched.pop()
        module.log_probs_from_logits = original


def _loaded() -> list[tuple[str, object]]:
    return [
        (name, module)
        for name, module in list(sys.modules.items())
        if (name == "openrlhf" or name.startswith("openrlhf.")) and module is not None
    ]
