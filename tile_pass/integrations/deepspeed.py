"""tile_pass in DeepSpeed (0.19) engines: ZeRO stages 0-3 and Ulysses sequence parallelism.

One line for every stage, after ``deepspeed.initialize`` and before the first step::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=..., config=...)
    backend = compile_engine(engine)  # inner="inductor"; tile_tokens=..., any tile_pass.backend option

At stages 0, 1 and 2 this is ``engine.compile(backend=tile_pass.backend(...))`` (which compiles
``engine.module``), and that line alone works there: the LM head and the loss are in one graph
(unless an earlier ZeRO-3 engine in the process replaced ``torch.nn.functional.linear``: below).
At stage 3 it first calls :func:`hand_head_to_tile_pass`, because ZeRO-3 hides the head from the
pass in two ways:

* Per-module hooks. ZeRO-3 keeps each parameter partitioned across the ranks and registers, on
  every submodule, a forward pre-hook that gathers the module's parameters (wrapped in
  ``torch.compiler.disable``: a graph break), a forward hook that releases them, and two more
  that do the same around the module's backward. Dynamo breaks the graph at the head's hooks,
  so the projection and the loss land in different graphs and the report says "the logits are
  an input of this graph".
* ``zero_optimization.memory_efficient_linear`` (default true). When the engine partitions the
  model (``deepspeed.zero.Init``), DeepSpeed replaces ``torch.nn.functional.linear`` for the
  whole process by ``zero3_linear_wrap``, i.e. ``LinearFunctionForZeroStage3.apply``: an
  autograd.Function whose backward is written by hand (it re-gathers the weight). tile_pass
  does not take an opaque autograd.Function for a projection, and DeepSpeed never puts torch's
  linear back: a model built later in the same process at stages 0-2 has the wrapper too.

:func:`hand_head_to_tile_pass` removes ZeRO's hooks from the head module only and registers the
head's parameters as *external parameters* of the top module
(``deepspeed.zero.register_external_parameter``): ZeRO then gathers them in the top module's
forward pre-hook and before the top module's backward, and releases them by its own rules (after
the forward unless its recorded trace keeps them for the backward that follows; at the end of
the backward), so the head weight is still partitioned between steps and all-gathered while it
is used (tests/test_deepspeed.py: gathered and released at the same points as under the head's
own hooks). The gathered weight lives from the start of the top module's forward instead of from
the head's call: one gathered head weight more during the backbone's forward. The head's
``forward`` is bound to torch's own linear when ``torch.nn.functional.linear`` is DeepSpeed's
wrapper, so the head and the loss after it form one graph that tile_pass rewrites, with a
derived backward (the report's ``matmul:`` line then names this module's
``_linear_with_torchs_linear``). The gradient still reaches ZeRO through the parameter's own
gradient hooks (reduce-scatter, and the partitioned optimizer step), untouched.

Loss recipes (measured in ``scripts/deepspeed_bench.py``; see docs/stacks.md): with the loss
``sum over the rank's tokens / the global count of valid tokens``, the gradient equals one
process on the whole batch when multiplied by the number of ranks whose gradients DeepSpeed
averages: the data-parallel world size at every stage without sequence parallelism; with
Ulysses sequence parallelism, 1 at stages 0-2 (DeepSpeed sums over the sequence-parallel group)
and the sequence-parallel size at stage 3 (ZeRO-3 averages over it before DeepSpeed 0.20.2).

DeepSpeed's own compiler (DeepCompile, ``"compile": {"deepcompile": true}``) is CUDA-only (its
op's C++ works on CUDA streams and events) and is not covered here.
"""

from __future__ import annotations

import types

import torch

from tile_pass.dynamo_backend import Backend
from tile_pass.integrations._head import backend_from

__all__ = ["compile_engine", "hand_head_to_tile_pass"]

# ``torch.nn.functional.linear`` is this builtin; DeepSpeed's ZeRO-3 rebinds the Python name
# (``torch.nn.functional.linear = zero3_linear_wrap``) and never restores it.
_TORCH_LINEAR = torch._C._nn.linear


def _linear_with_torchs_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with torch's linear, not ZeRO-3's ``LinearFunctionForZeroStage3``."""
    return _TORCH_LINEAR(input, self.weight, self.bias)


def _head_of(engine, head: torch.nn.Module | None) -> torch.nn.Linear:
    if head is None:
        get = getattr(engine.module, "get_output_embeddings", None)
        head = get() if get is not None else None
        if head is None:
            raise ValueError(
                f"{type(engine.module).__name__} has no get_output_embeddings(): pass the LM head "
                f"module as head="
            )
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the LM head must be a torch.nn.Linear, got {type(head).__name__}")
    return head


def _zero3_offload(engine):
    """DeepSpeed's ``DeepSpeedZeRoOffload``: the object that holds ZeRO-3's module hooks (the
    optimizer's ``parameter_offload`` in training, the engine's optimizer slot in inference)."""
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    if not hasattr(offload, "forward_hooks") or not hasattr(offload, "backward_hooks"):
        raise TypeError(
            f"no ZeRO-3 parameter offload found on the engine (optimizer {type(optimizer).__name__}); "
            f"call hand_head_to_tile_pass after deepspeed.initialize"
        )
    return offload


def hand_head_to_tile_pass(engine, head: torch.nn.Module | None = None) -> torch.nn.Linear:
    """Put ``engine``'s LM head and the loss after it in one graph for tile_pass.

    ``head`` defaults to ``engine.module.get_output_embeddings()`` (Hugging Face models) and must
    be a ``torch.nn.Linear``. At ZeRO stage 3 the head's ZeRO hooks are removed and its
    parameters become external parameters of ``engine.module``, so ZeRO gathers and releases them
    around the top module's forward and backward instead of the head's (see the module
    docstring). At any stage, when ``torch.nn.functional.linear`` is no longer torch's (this
    engine's or an earlier ZeRO-3 engine's ``memory_efficient_linear`` replaced it), the head's
    forward is bound to torch's linear. Call it after ``deepspeed.initialize`` and before the
    first step; calling it again changes nothing. Returns the head.
    """
    head = _head_of(engine, head)
    if engine.zero_optimization_partition_weights():
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        offload = _zero3_offload(engine)
        head_hooks = (head._forward_pre_hooks, head._forward_hooks)
        for handles in (offload.forward_hooks, offload.backward_hooks):
            kept = []
            for handle in handles:
                if any(handle.hooks_dict_ref() is hooks for hooks in head_hooks):
                    handle.remove()
                else:
                    kept.append(handle)
            handles[:] = kept
        for param in head.parameters(recurse=False):
            register_external_parameter(engine.module, param)
        # the parameter coordinator records which module fetches what in the first step and
        # prefetches by that record afterwards; DeepSpeed invalidates it when hooks change
        coordinator = offload.get_param_coordinator()
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
    if torch.nn.functional.linear is not _TORCH_LINEAR:  # ZeRO-3's memory_efficient_linear
        head.forward = types.MethodType(_linear_with_torchs_linear, head)
    return head


def compile_engine(
    engine, inner="inductor", *, head: torch.nn.Module | None = None, **backend_options
) -> Backend:
    """The one line for a DeepSpeed engine at any ZeRO stage: :func:`hand_head_to_tile_pass`
    (``head=`` as there), then ``engine.compile(backend=tile_pass.backend(inner, **backend_options))``.
    ``inner`` may also be a ready :class:`tile_pass.Backend`. Returns the backend (``.report()``
    says what was rewritten)."""
    backend = backend_from(inner, backend_options)
    hand_head_to_tile_pass(engine, head)
    engine.compile(backend=backend)
    return backend
