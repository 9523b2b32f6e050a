"""tile_pass in torchtune (0.6): the output projection and the cross entropy in one tiled graph.

torchtune's recipes run the model's output projection inside the model (``TransformerDecoder.
unembed``: final norm, then ``output``, chunked along the sequence when the loss is
``CEWithChunkedOutputLoss``) and the loss afterwards, on the logits; ``compile: True`` compiles
each transformer layer and the loss's ``compute_cross_entropy`` on their own. The projection is
in no compiled graph and the loss's graph receives the logits as an input, so tile_pass has
nothing to tile there. The one line below moves the projection out of the model and into the
loss, which compiles "output projection + cross entropy" as one function with
``tile_pass.backend``::

    recipe.setup(cfg)
    hand_head_to_tile_pass(recipe)  # the one line, before recipe.train()
    recipe.train()

The model then returns its final hidden states (after the final norm) instead of logits, and
the recipe's loss (``recipe._loss_fn``, which the recipe calls as ``loss_fn(logits, labels)``)
becomes a :class:`TiledCrossEntropyLoss` over the model's own ``output`` module: the same
token-mean cross entropy with the same ``ignore_index``, whose gradient AOTAutograd derives.
``restore_output_layer(model)`` gives the model its logits back (for generation or
evaluation).
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

import tile_pass
from tile_pass.integrations._head import CompiledHead, backend_from

__all__ = [
    "TiledCrossEntropyLoss",
    "hand_head_to_tile_pass",
    "report",
    "restore_output_layer",
    "skip_output_layer",
]


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The ``TransformerDecoder`` of a model (a ``DeepFusionModel``'s ``.decoder``)."""
    from torchtune.modules import TransformerDecoder

    if isinstance(model, TransformerDecoder):
        return model
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, TransformerDecoder):
        return decoder
    raise TypeError(f"expected a torchtune TransformerDecoder (or a model with one as .decoder), got "
                    f"{type(model).__name__}")  # fmt: skip


def _final_hidden_states(self, h: torch.Tensor) -> torch.Tensor:
    return self.norm(h)


def skip_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` return its final hidden states (after the final norm) instead of logits.

    Replaces the decoder's ``unembed`` on the instance and turns off output chunking
    (``set_num_output_chunks``); the output projection is then left to
    :class:`TiledCrossEntropyLoss`. Returns ``model``.
    """
    decoder = _decoder(model)
    decoder.num_output_chunks = 0
    decoder.unembed = types.MethodType(_final_hidden_states, decoder)
    return model


def restore_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`skip_output_layer`: the model returns logits again (unchunked)."""
    decoder = _decoder(model)
    decoder.__dict__.pop("unembed", None)
    return model


def _default_inner() -> str:
    # torchtune's own compile helpers read the same variable
    return os.environ.get("TORCH_COMPILE_BACKEND", "inductor")


class TiledCrossEntropyLoss(torch.nn.Module):
    """``cross_entropy(output(hidden).float(), labels)``, token mean over labels that are not
    ``ignore_index``, compiled as one function with ``tile_pass.backend(inner)``.

    ``output`` is the model's output projection (``model.output``: an ``nn.Linear`` or a
    ``TiedLinear``); the loss is called as the recipe calls its loss, ``loss(hidden, labels)``,
    with ``hidden`` of shape ``[tokens, dim]`` or ``[batch, seq, dim]`` and labels of the
    matching shape. ``inner`` and ``backend_options`` are taken as by every integration
    (:mod:`tile_pass.integrations._head`); ``inner`` defaults to ``$TORCH_COMPILE_BACKEND`` or
    ``"inductor"``. ``.backend.report()`` (or
    :func:`report`) says what was rewritten.
    """

    def __init__(self, output, *, ignore_index: int = -100, inner=None, **backend_options):
        super().__init__()
        self.output = output
        self.ignore_index = ignore_index
        self._compiled = CompiledHead(
            self._head_and_loss, backend_from(inner, backend_options, default=_default_inner())
        )
        self.backend = self._compiled.backend

    def _head_and_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(hidden).float()  # as TransformerDecoder.unembed
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(hidden, (list, tuple)):
            raise TypeError(
                "TiledCrossEntropyLoss got a list: the model still chunks its output or returns "
                "intermediate hidden states (output_hidden_states); call skip_output_layer(model) "
                "and leave output_hidden_states empty"
            )
        return self._compiled(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


def _check_loss(loss) -> int:
    """The ``ignore_index`` of a loss tile_pass can stand in for; raise for any other."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    if isinstance(loss, (CEWithChunkedOutputLoss, TiledCrossEntropyLoss)):
        return loss.ignore_index
    if type(loss) is torch.nn.CrossEntropyLoss:
        plain = loss.reduction == "mean" and loss.weight is None and loss.label_smoothing == 0.0
        if plain:
            return loss.ignore_index
    raise TypeError(
        f"hand_head_to_tile_pass replaces a token-mean cross entropy (CEWithChunkedOutputLoss or a "
        f"plain torch.nn.CrossEntropyLoss); the recipe's loss is {type(loss).__name__}"
    )


def hand_head_to_tile_pass(recipe, inner=None, **backend_options) -> TiledCrossEntropyLoss:
    """The one line for a torchtune recipe, after ``recipe.setup(cfg)`` and before
    ``recipe.train()``: the recipe's model returns hidden states and its loss becomes a
    :class:`TiledCrossEntropyLoss` over the model's output projection, with the loss's
    ``ignore_index``. Works with the recipes that keep the model in ``recipe._model`` and the
    loss in ``recipe._loss_fn`` (``full_finetune_single_device``, ``full_finetune_distributed``,
    ``lora_finetune_single_device``, ``lora_finetune_distributed``). Returns the new loss.
    """
    model, loss = recipe._model, recipe._loss_fn
    if isinstance(loss, TiledCrossEntropyLoss):
        return loss
    ignore_index = _check_loss(loss)
    skip_output_layer(model)
    recipe._loss_fn = TiledCrossEntropyLoss(
        _decoder(model).output, ignore_index=ignore_index, inner=inner, **backend_options
    )
    return recipe._loss_fn


def report(obj) -> tile_pass.Report:
    """The backend's report for a recipe handed over by :func:`hand_head_to_tile_pass`, or
    for a :class:`TiledCrossEntropyLoss`."""
    loss = obj if isinstance(obj, TiledCrossEntropyLoss) else getattr(obj, "_loss_fn", None)
    if not isinstance(loss, TiledCrossEntropyLoss):
        raise TypeError(
            f"{type(obj).__name__} has no TiledCrossEntropyLoss: call hand_head_to_tile_pass(recipe) first"
        )
    return loss.backend.report()
