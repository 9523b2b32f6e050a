"""Log calls that Dynamo cannot trace, between an LM head and its loss.

Dynamo (torch 2.13) ends the graph at every ``logging.Logger`` method call ("logging.Logger
method not supported for non-export cases"). transformers' ``PreTrainedModel.loss_function``
makes one, ``logger.warning_once(...)``, whenever a model's ``loss_type`` is unset (GPT-2, GPT-SW3,
OpenAI-GPT, CTRL, BERT and BERT-generation as causal LMs): the head's logits end one graph and the
loss starts the next, so the pass sees each half alone.

Dynamo offers two settings. ``reorderable_logging_functions`` keeps a call by moving it after the
graph, but only for plain functions reached as themselves (``print``, a module-level function); a
logger's method is traced as a ``LoggingLoggerVariable``, whose only treatment is
``ignore_logging_functions``: the call is dropped from the compiled code. So the pass drops the
fewest lines it can: transformers' once-per-process advisories (``warning_once``, ``info_once``),
and only while a function compiled by one of tile_pass's entry points runs (:func:`traced_past`),
never for the process; every other log call still breaks the graph and is still printed. The
one such line these models print, the ``loss_type`` fallback, is printed by transformers itself
when the entry point compiles the model (:func:`announce_loss_fallback`), as its first eager
forward would. The settings are only read while Dynamo traces, so the backend behind
``backend="tile_pass"`` (called after Dynamo has traced) cannot set them; the report then names
them (:func:`logging_break_hint`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator

import torch

#: transformers' once-per-process logger methods (installed on ``logging.Logger`` when
#: ``transformers.utils.logging`` is imported): the calls tile_pass's entry points trace past
ONCE_ONLY_METHODS = ("warning_once", "info_once")
SETTING = "torch._dynamo.config.ignore_logging_functions"
#: the one-line entry points that trace past those calls
ENTRY_POINTS = "tile_pass.compile(model) or tile_pass.integrations.transformers.compile_for_training(model)"


def once_only_calls() -> set:
    """transformers' once-only logger methods, where transformers is imported (else none)."""
    found = (getattr(logging.Logger, name, None) for name in ONCE_ONLY_METHODS)
    return {method for method in found if callable(method)}


@contextlib.contextmanager
def traced_past() -> Iterator[None]:
    """While it is open, Dynamo traces past transformers' once-only log calls (dropping them
    from what it compiles) instead of ending the graph there; the setting is restored on exit."""
    current = set(torch._dynamo.config.ignore_logging_functions)
    added = once_only_calls() - current
    if not added:
        yield
        return
    with torch._dynamo.config.patch(ignore_logging_functions=current | added):
        yield


def announce_loss_fallback(model: object) -> None:
    """Print transformers' ``loss_type`` fallback advisory now, as its first eager forward would:
    the compiled forward traces past it. (The property logs it once per process, through
    ``warning_once``, and has no other effect.)"""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, torch.nn.Module):
        return
    for module in model.modules():
        if not isinstance(module, transformers.PreTrainedModel):
            continue
        with contextlib.suppress(Exception):  # a model without a head, or an unusual property
            if module.get_output_embeddings() is not None:
                module.loss_function  # noqa: B018 - the property logs the advisory


_METHOD = re.compile(r"method: <Logger ([^ >]+)[^>]*>\.(\w+)")


def logging_break_hint(reason: str) -> str:
    """The exact setting that keeps a logger call from breaking the graph, for Dynamo's reason."""
    found = _METHOD.search(reason)
    logger, method = found.groups() if found else ("", "")
    call = f"`{logger}` logger's `.{method}(...)`" if found else "the logger call"
    if method in ONCE_ONLY_METHODS:
        loss_type = (
            '; or, for this advisory, set model.loss_type = "ForCausalLM", the loss transformers falls '
            "back to"
            if "loss_type=" in reason
            else ""
        )
        return (
            f"{call} is one of transformers' once-per-process advisories; compile with {ENTRY_POINTS}, "
            "which let Dynamo trace past those calls while the model runs, or, with torch.compile, add it "
            f"for the process: {SETTING}.add(logging.Logger.{method}) (Dynamo then drops that call from "
            f"compiled code){loss_type}"
        )
    named = f"logging.Logger.{method}" if method else "the logging method"
    return (
        f"move {call} out from between the LM head and the loss, or add {named} to {SETTING} (Dynamo "
        "then drops every such call from compiled code)"
    )
