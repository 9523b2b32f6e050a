"""tile_pass with ``transformers.Trainer`` and accelerate: ``compile_for_training(model)``.

The ways that do not work, and why (transformers 5.24, accelerate 1.15):

* ``TrainingArguments(torch_compile_backend="tile_pass")``: accelerate checks the name
  against its fixed ``DynamoBackend`` enum when the Trainer is built and raises
  ``ValueError: 'TILE_PASS' is not a valid DynamoBackend``.
* ``Trainer(model=torch.compile(model, ...))``: the wrapper's ``forward`` takes
  ``(*args, **kwargs)``, so ``remove_unused_columns`` finds no dataset column the model
  accepts ("No columns in the dataset match the model's forward method signature").
* ``model.compile(backend=...)`` works in float32. Under mixed precision
  (``bf16=True``) accelerate wraps ``model.forward`` in autocast and ``_convert_to_fp32``;
  ``nn.Module.compile`` compiles ``__call__``, so that upcast of the returned logits lands in
  the graph, a second consumer of the logits, and the pass must leave the head alone.

:func:`compile_for_training` compiles the model's own ``forward`` function and binds it
back to the model as its ``forward``: the model keeps its class, signature, parameter names
and ``save_pretrained``; ``copy.deepcopy`` rebinds the copy's forward to the copy (TRL's
reference models are deep copies); accelerate's autocast and fp32 conversion wrap the
compiled forward from outside, as they wrap an uncompiled one.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any

import torch
import transformers

import tile_pass
from tile_pass import _logging_calls
from tile_pass.dynamo_backend import Backend
from tile_pass.integrations import _trl_heads
from tile_pass.integrations._forward import forward_chain, model_of
from tile_pass.integrations._head import backend_from
from tile_pass.report import Report
from tile_pass.rewrite import LEFT_WHOLE

log = logging.getLogger(__name__)

_BACKENDS: weakref.WeakKeyDictionary[torch.nn.Module, Backend] = weakref.WeakKeyDictionary()


def compile_for_training(
    model: torch.nn.Module,
    inner: str | Backend | Any = "inductor",
    *,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    **backend_options: Any,
) -> torch.nn.Module:
    """Compile ``model``'s forward with tile_pass, in place; return ``model``.

    ``inner`` and ``backend_options`` are :func:`tile_pass.backend`'s (``inner="aot_eager"``,
    ``tiling=TileOptions(...)`` or its fields, ``tile_tokens=...``, ``drop_logits=True``,
    ``mode=...``, ...), or ``inner`` is a ready
    :class:`tile_pass.Backend`. ``dynamic`` and ``fullgraph`` go to ``torch.compile``.

    Call it before building the ``Trainer`` (or an ``SFTTrainer``, or inside a
    ``LightningModule``); works for any ``nn.Module`` whose ``forward`` computes the loss,
    PEFT models included. ``report(model)`` shows what the pass did. As with
    :func:`tile_pass.compile`, Dynamo traces past transformers' once-only log calls while the
    forward runs (the ``loss_type`` advisory of GPT-2-style models would split head and loss);
    the model is left as it is.
    """
    backend = backend_from(inner, backend_options)
    if backend_of(model) is not None:
        raise ValueError("this model's forward is already compiled with tile_pass")
    current = model.__dict__.get("forward")
    if current is None:
        func = type(model).forward
    elif isinstance(current, types.MethodType) and current.__self__ is model:
        func = current.__func__
    else:
        raise ValueError(
            f"{type(model).__name__}.forward was replaced by {current!r}, which is not a method of the "
            "model; call compile_for_training before handing the model to a trainer"
        )
    # transformers' once-only log calls (GPT-2's loss_type advisory) do not split head and loss
    _logging_calls.announce_loss_fallback(model)
    compiled = tile_pass.compile(func, backend, dynamic=dynamic, fullgraph=fullgraph)
    compiled._tile_pass_backend = backend
    model.forward = types.MethodType(compiled, model)
    _BACKENDS[model] = backend
    return model


def backend_of(obj) -> Backend | None:
    """The :class:`tile_pass.Backend` that :func:`compile_for_training` compiled ``obj`` (a
    model, a submodule's parent, a deep copy, or a trainer) with, or ``None``."""
    for module in model_of(obj).modules():
        backend = _BACKENDS.get(module)
        if backend is not None:
            return backend
        for f in forward_chain(module):
            backend = getattr(f, "_tile_pass_backend", None)
            if isinstance(backend, Backend):
                return backend
    return None


def report(obj, backend: Backend | None = None) -> Report:
    """What tile_pass did for ``obj`` (a model or a trainer), with hints about the stack.

    The backend is ``backend``, else the one :func:`compile_for_training` used, else
    ``backend="tile_pass"``'s (:func:`tile_pass.default_backend`, for ``model.compile(
    backend="tile_pass")``). ``report.hints`` names what in the stack kept the pass from the
    head: TRL's fused head, accelerate's fp32 upcast of the returned logits.
    """
    found = backend or backend_of(obj)
    result = (found or tile_pass.default_backend()).report()
    hints = []
    if found is None:
        hints.append(
            "this model was not compiled by compile_for_training; the report is backend='tile_pass''s "
            "(tile_pass.default_backend())"
        )
    trl_hint = _trl_heads.fused_lm_head_hint(obj)
    if trl_hint:
        hints.append(trl_hint)
    elif not result.rewrites and all(LEFT_WHOLE in skip.reason for skip in result.skipped):
        hints.append(
            "the model's forward is not TRL's fused head; no compiled graph had a projection reaching a "
            "cross_entropy (generation and evaluation without labels have none: their logits leave the "
            "graph whole; a loss computed outside the compiled forward is not seen)"
        )
    if any("_convert_to_fp32" in skip.reason for skip in result.skipped):
        hints.append(
            "accelerate's mixed precision upcasts the returned logits (_convert_to_fp32) inside the "
            "compiled graph: the model was compiled as a whole (model.compile() / torch.compile(model)). "
            "tile_pass.integrations.transformers.compile_for_training(model) compiles its forward instead, "
            "which keeps accelerate's wrappers outside the graph"
        )
    result.hints = hints
    return result


class TilePassCallback(transformers.TrainerCallback):
    """``Trainer(..., callbacks=[TilePassCallback()])``: compiles the model with
    :func:`compile_for_training` when the trainer is built (unless it already is), and logs
    :func:`report` after the first optimizer step: at INFO when a head was rewritten, as a
    WARNING with the reasons when none was. The report is kept in ``.report``.

    Arguments are :func:`compile_for_training`'s.
    """

    def __init__(self, inner: str | Backend | Any = "inductor", **options: Any):
        self.inner = inner
        self.options = options
        self.report: Report | None = None

    def _compile(self, model) -> None:
        if model is not None and backend_of(model) is None:
            compile_for_training(model, self.inner, **self.options)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._compile(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._compile(model)  # added with trainer.add_callback after the trainer was built

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.report is not None or model is None:
            return
        self.report = report(model)
        if self.report.rewrites:
            log.info("%s", self.report)
        else:
            log.warning("tile_pass rewrote no LM head in the first training step:\n%s", self.report)


__all__ = ["TilePassCallback", "backend_of", "compile_for_training", "report"]
