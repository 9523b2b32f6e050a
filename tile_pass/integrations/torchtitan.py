"""tile_pass in torchtitan (0.3): the LM head and its cross entropy in one tiled graph.

torchtitan's trainer runs ``pred = model(inputs)`` and then ``loss_fn(pred, labels,
global_valid_tokens)``. With ``compile.enable`` it compiles each ``TransformerBlock`` on its
own and (``"loss"`` in ``compile.components``) the loss function on its own; the final norm and
``lm_head`` run in no compiled graph, so the loss's graph receives the logits and tile_pass has
nothing to tile. Its shipped configs use ``ChunkedLossWrapper`` instead (``lm_head`` + cross
entropy per sequence chunk, each chunk's backward run inside the forward); there too the head
runs outside any graph.

:class:`TiledCrossEntropyLoss` is a loss for the trainer's ``loss`` config: the trainer hands it
the ``lm_head`` and makes the model return its final hidden states (as it does for
``ChunkedLossWrapper``), and it compiles "``lm_head`` + cross entropy (sum over the labels)" as
one function with ``tile_pass.backend``, then divides by the global token count as torchtitan's
losses do. The one config value that puts it in place of the config's own loss is torchtitan's
override mechanism::

    --override.imports tile_pass.integrations.torchtitan.tiled_loss

(or ``config.loss = TiledCrossEntropyLoss.Config()`` in a Python config). Data parallelism
(FSDP2, torchtitan's default ``dp_shard=-1``) needs nothing more: ``lm_head`` is in the root
norm's FSDP group, whose weight is all-gathered when the norm runs. A vocabulary-sharded head
(tensor parallelism) is tiled with ``--parallelism.spmd_backend partial_dtensor``, where
``lm_head``'s weight is a ``DTensor`` sharded over the vocabulary: the cross entropy runs under
``loss_parallel()`` and the report says ``tensor-parallel: degree N``. Under the default
``"spmd_types"`` backend with ``tensor_parallel_degree > 1`` the weight is a plain local shard
typed by spmd_types, which tile_pass does not read; the loss raises and says so. (With torch
2.13, torchtitan 0.3's own ``"spmd_types"`` and ``"full_dtensor"`` backends do not build a model
on more than one rank at all: ``fully_shard`` refuses their parameters.)

torchtitan 0.3 imports triton when it is imported (its MoE expert-parallel kernels). On a torch
without triton (CPU-only builds) this module stands in a module for those kernels whose
functions raise when called, so that the dense models import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import tile_pass
from tile_pass._options import TileOptions, tile_options
from tile_pass.integrations._head import CompiledHead, backend_from

_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stand_in_for_the_triton_kernels() -> None:
    if importlib.util.find_spec("triton") is not None or _EP_KERNELS in sys.modules:
        return
    stub = types.ModuleType(
        _EP_KERNELS, "stands in for torchtitan's triton kernels (triton is not installed)"
    )

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise RuntimeError(f"{_EP_KERNELS}.{name} needs triton, which is not installed")

        return missing

    stub.__getattr__ = __getattr__
    sys.modules[_EP_KERNELS] = stub


_stand_in_for_the_triton_kernels()

from torchtitan.components.loss import (  # noqa: E402
    IGNORE_INDEX,
    BaseLoss,
    ChunkedLossWrapper,
    CrossEntropyLoss,
)
from torchtitan.config.override import override  # noqa: E402

__all__ = ["TiledCrossEntropyLoss", "report", "tiled_loss"]


def _head_and_loss(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def _tp_inputs(hidden, lm_head):
    """A vocabulary-sharded DTensor weight (``Shard(0)``): the hidden states replicated on its
    mesh (as ``lm_head``'s own sharding config makes them) and ``loss_parallel()`` for the loss;
    otherwise the inputs as they are."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    weight, bias = lm_head.weight, lm_head.bias
    if not isinstance(weight, DTensor) or not any(p == Shard(0) for p in weight.placements):
        return hidden, weight, bias, contextlib.nullcontext()
    replicated = [Replicate()] * weight.device_mesh.ndim
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(weight.device_mesh, replicated)
    else:
        hidden = DTensor.from_local(hidden, weight.device_mesh, replicated, run_check=False)
    return hidden, weight, bias, loss_parallel()


def _check_spmd_types_tp() -> None:
    from torchtitan.distributed.spmd_types import spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        raise NotImplementedError(
            "tile_pass's TiledCrossEntropyLoss reads a vocabulary-sharded lm_head as a DTensor; under "
            "parallelism.spmd_backend='spmd_types' with tensor parallelism its weight is a plain local "
            "shard. Use --parallelism.spmd_backend partial_dtensor."
        )


class TiledCrossEntropyLoss(ChunkedLossWrapper):
    """Cross entropy over the model's own ``lm_head``, compiled as one function with
    ``tile_pass.backend(inner)``: the summed loss over labels that are not ``IGNORE_INDEX``,
    divided by ``global_valid_tokens``, like torchtitan's ``CrossEntropyLoss``.

    A ``ChunkedLossWrapper`` to the trainer, which therefore calls :meth:`set_lm_head` and sets
    the model's ``_skip_lm_head`` (``pred`` is then the final norm's output); its chunking is not
    used. ``inner`` defaults to ``compile.backend``; ``.backend.report()`` says what was
    rewritten.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        inner: str | None = None
        """Compiler for the rewritten graph; None: the trainer's ``compile.backend``."""

        tiling: TileOptions | None = None
        """How the tiles are made (:class:`tile_pass.TileOptions`); None: its defaults."""

    def __init__(self, config: Config, *, compile_config=None):
        inner = config.inner or getattr(compile_config, "backend", None) or "inductor"
        self.num_chunks = 1
        self.loss_fn = None
        self.lm_head = None
        self._compiled = CompiledHead(_head_and_loss, backend_from(inner, {"tiling": config.tiling}))
        self.backend = self._compiled.backend

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        lm_head = self.lm_head
        if lm_head is None:
            raise RuntimeError("TiledCrossEntropyLoss has no lm_head: the trainer sets it (set_lm_head)")
        _check_spmd_types_tp()
        if isinstance(lm_head, FSDPModule):
            lm_head.unshard()  # the group's all-gathered weight (FSDP2 keeps it until backward)
        hidden, weight, bias, context = _tp_inputs(pred, lm_head)
        with context:
            loss = self._compiled(hidden, weight, bias, labels)
        if isinstance(loss, DTensor):
            loss = loss.to_local()  # replicated over the tensor-parallel ranks, as torchtitan's own
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


@override(
    target=BaseLoss.Config,
    fqns=["loss"],
    description="tile_pass: lm_head and cross entropy in one tiled graph",
)
def tiled_loss(cfg, *, inner: str | None = None, **backend_options: Any):
    """``--override.imports tile_pass.integrations.torchtitan.tiled_loss``: the trainer's
    ``CrossEntropyLoss`` or ``ChunkedLossWrapper`` (of a ``CrossEntropyLoss``) becomes a
    :class:`TiledCrossEntropyLoss`; any other loss raises. ``inner`` and ``backend_options`` as
    every integration takes them (:mod:`tile_pass.integrations._head`), given as the override's
    arguments (``tiled_loss={"inner": "aot_eager", "tile_tokens": 1024}``) or from Python
    (``tiling=``); the trainer's config carries the tiling, so only it may be given."""
    entry = "tile_pass.integrations.torchtitan.tiled_loss"
    tiling = tile_options(entry, backend_options.pop("tiling", None), backend_options, ("cfg", "inner"))
    loss = cfg.loss_fn if type(cfg) is ChunkedLossWrapper.Config else cfg
    if type(loss) is not CrossEntropyLoss.Config and not isinstance(cfg, TiledCrossEntropyLoss.Config):
        raise ValueError(
            f"tile_pass.integrations.torchtitan.tiled_loss replaces a cross entropy loss; the config's "
            f"loss is {type(cfg).__qualname__}"
        )
    return TiledCrossEntropyLoss.Config(inner=inner, tiling=tiling)


def report(obj) -> tile_pass.Report:
    """The backend's report of a :class:`TiledCrossEntropyLoss` or of a trainer using one."""
    loss = obj if isinstance(obj, TiledCrossEntropyLoss) else getattr(obj, "loss_fn", None)
    if not isinstance(loss, TiledCrossEntropyLoss):
        raise TypeError(f"{type(obj).__name__} does not use tile_pass's TiledCrossEntropyLoss")
    return loss.backend.report()
