"""TRL: its trainers bring their own chunked LM head; :func:`hand_head_to_tile_pass` hands it to tile_pass.

TRL (1.16) ``SFTTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``DPOTrainer`` and ``KTOTrainer``
call ``trl.trainer.utils.add_fused_lm_head(model)`` when they are built (on the reference model
too). It replaces the model's ``forward`` (an instance attribute) with one that, called with
``fused_lm_head=True`` (as the trainers' losses do), runs the backbone and then TRL's
``ChunkedLogProbFunction``: per-token log-probabilities (and, as each trainer asks, entropies,
mean logits, whether the label is the top-1 token, ``log(sum p^2)``) computed in chunks, never
the ``[tokens, vocab]`` logits. No ``linear + cross_entropy`` is left for tile_pass to find. TRL
1.16 has no setting that turns the head off: the patch is unconditional.

:func:`hand_head_to_tile_pass` (call it after building the trainer, before ``train()``):

* ``SFTTrainer``: restores the forward TRL replaced and makes the trainer compute the model's own
  loss (SFT's ``"nll"`` loss at temperature 1 is that loss), which tile_pass tiles when
  :func:`tile_pass.integrations.transformers.compile_for_training` compiled the forward.
* every other trainer whose model (or reference model) carries TRL's head (GRPO, RLOO, DPO,
  KTO): replaces TRL's forward with one that, called with ``fused_lm_head=True``, runs the same
  backbone and the model's own ``lm_head`` weight, then computes the fields TRL's head returns
  (with TRL's temperature, logit scale and soft-cap, read from TRL's patch) with plain torch ops
  (``log_softmax`` + ``gather``, the entropy from ``softmax * log_softmax``, ``argmax``,
  ``logsumexp``), all in one function compiled with the tile_pass backend. tile_pass finds the head
  and every per-token quantity in one graph and tiles them; the backward is AOTAutograd's
  derivative of those ops, so the entropy term, where a loss uses it, gets its exact gradient.
  The trainer's own loss code runs unchanged on the same ``FusedCausalLMOutput``. Called
  without ``fused_lm_head`` (generation), the model's forward runs as before.

Detection needs no import of TRL; :func:`hand_head_to_tile_pass` imports it.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from tile_pass.integrations._forward import forward_chain, models_of
from tile_pass.integrations._head import CompiledHead, backend_from
from tile_pass.integrations._trl_heads import (
    _is_trl_fused_forward,
    fused_lm_head_hint,
    fused_lm_head_modules,
    tiled_lm_head_modules,
)

#: the names TRL 1.16's ``_fused_forward`` closes over that the tiled head needs
_TRL_SETTINGS = (
    "original_forward",
    "temperature",
    "cast_lm_head_to_fp32",
    "outputs",
    "final_logit_softcapping",
    "logit_scale",
    "backbone_attr",
    "text_config",
)
#: every per-token field of TRL's ``FusedCausalLMOutput``, in its order
_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _closure(func) -> dict[str, Any]:
    code = func.__code__
    return {
        name: cell.cell_contents for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=True)
    }


def _original_forward(fused: types.MethodType):
    """The forward TRL wrapped: its closure's ``original_forward``."""
    return _closure(fused.__func__)["original_forward"]


def _trl_settings(fused: types.MethodType) -> dict[str, Any]:
    cells = _closure(fused.__func__)
    missing = [name for name in _TRL_SETTINGS if name not in cells]
    if missing:
        raise RuntimeError(
            f"TRL's fused head no longer closes over {missing} (this TRL is newer than 1.16): "
            "hand_head_to_tile_pass cannot read its settings; TRL's head is left in place"
        )
    return {name: cells[name] for name in _TRL_SETTINGS}


def per_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    outputs: tuple[str, ...] = ("log_probs",),
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy_grad: bool = True,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor | None]:
    """TRL's fused-head fields from hidden states, in plain torch ops that tile_pass tiles.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` ``[...]`` (the next-token ids,
    ``ignore_index`` where nothing is scored). The logits ``hidden @ weight.T + bias`` are taken
    in float32, times ``logit_scale``, soft-capped (``softcap * tanh(z / softcap)``), divided by
    ``temperature``; then, per token, as TRL's ``FusedCausalLMOutput`` defines them: ``log_probs``
    (always), and those of ``entropy``, ``log_sum_sq_probs`` (``log sum_v p_v^2``), ``mean_logits``,
    ``is_top1`` named in ``outputs`` (the others are ``None``). Every field is zero where the label
    is ``ignore_index``. ``log_probs`` and ``entropy`` are differentiable (the entropy detached
    when ``entropy_grad=False``); the other fields are not.

    Eagerly it makes the whole logits; traced inside a graph compiled with
    :func:`tile_pass.backend` (as :func:`hand_head_to_tile_pass` compiles it) the projection and
    every field are one tiled region.
    """
    unknown = set(outputs) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown outputs {sorted(unknown)}; expected some of {_FIELDS}")
    torch._check(
        labels.dim() == hidden.dim() - 1, lambda: "labels must be hidden's shape without its last dim"
    )
    for i in range(labels.dim()):
        # one label per hidden state; under dynamic shapes this also tells the graph that the two
        # token dims are one symbol, so that the gather reads one id per token
        torch._check(
            labels.shape[i] == hidden.shape[i], lambda: "labels must be hidden's shape without its last dim"
        )
    mask = labels != ignore_index
    ids = labels.clamp(min=0)
    logits = F.linear(hidden, weight, bias)
    z = logits.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    logp = z.log_softmax(-1)
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(_FIELDS)
    fields["log_probs"] = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if "entropy" in outputs:
        entropy = -(z.softmax(-1) * logp).sum(-1)
        fields["entropy"] = entropy if entropy_grad else entropy.detach()
    if "log_sum_sq_probs" in outputs:
        fields["log_sum_sq_probs"] = (2 * logp).logsumexp(-1).detach()
    if "mean_logits" in outputs:
        fields["mean_logits"] = z.mean(-1).detach()
    if "is_top1" in outputs:
        fields["is_top1"] = z.argmax(-1) == ids
    for name, x in fields.items():
        if x is not None:
            fields[name] = x.masked_fill(~mask, 0)  # zero where no label is scored, as TRL's head
    return fields


def _router_loss(text_config, backbone_outputs, attention_mask):
    """The MoE load-balancing loss the model's own forward adds (Mixtral's, as TRL's head uses)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = getattr(text_config, "num_experts", None) or text_config.num_local_experts
    return load_balancing_loss_func(
        backbone_outputs.router_logits, experts, text_config.num_experts_per_tok, attention_mask
    )


def _head_program(settings: dict[str, Any], entropy_grad: bool):
    """The function a ``fused_lm_head=True`` call runs: backbone, head and per-token fields."""
    text_config = settings["text_config"]
    backbone_attr = settings["backbone_attr"]
    outputs = tuple(settings["outputs"])
    options = dict(
        outputs=outputs,
        temperature=settings["temperature"],
        logit_scale=settings["logit_scale"],
        softcap=settings["final_logit_softcapping"],
        entropy_grad=entropy_grad,
    )
    cast_fp32 = settings["cast_lm_head_to_fp32"]
    router = bool(getattr(text_config, "output_router_logits", False))

    def trl_head(model, args, kwargs, labels, shift_labels, num_items_in_batch):
        kwargs = {**kwargs, "use_cache": False}
        if router:
            kwargs.setdefault("output_router_logits", True)
        backbone_outputs = getattr(model, backbone_attr)(*args, **kwargs)
        hidden = backbone_outputs.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2: a sharded DTensor head, gathered as TRL does
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        if cast_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                fields = per_token_outputs(hidden.float(), weight, labels, bias, **options)
        else:
            fields = per_token_outputs(hidden, weight, labels, bias, **options)
        mask = labels != -100
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -fields["log_probs"].sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _router_loss(text_config, backbone_outputs, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return {"loss": loss, **fields, "label_mask": mask, "aux_loss": aux_loss}

    return trl_head, outputs


def _describe(outputs: tuple[str, ...], entropy_grad: bool) -> str:
    names = [
        f"{name} ({'with' if entropy_grad else 'without'} gradient)" if name == "entropy" else name
        for name in _FIELDS
        if name == "log_probs" or name in outputs
    ]
    return ", ".join(names)


def _tiled_forward(module, fused, backend, entropy_grad: bool, name: str):
    """The forward that replaces TRL's ``fused`` on ``module``, as a bound method."""
    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

    settings = _trl_settings(fused)
    original = settings["original_forward"]
    program, outputs = _head_program(settings, entropy_grad)
    compiled = CompiledHead(program, backend, name)

    @functools.wraps(type(module).forward)  # generate() checks its kwargs against this signature
    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        head = self.get_output_embeddings()
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            fields = compiled(self, args, kwargs, labels, shift_labels, num_items_in_batch)
        return FusedCausalLMOutput(**fields)

    forward._tile_pass_backend = backend
    forward._tile_pass_trl_head = _describe(outputs, entropy_grad)
    return types.MethodType(forward, module)


def _entropy_needs_grad(trainer) -> bool:
    """Whether the trainer's loss differentiates the entropy it asks TRL's head for.

    TRL 1.16: GRPO adds an entropy bonus when ``entropy_coef != 0`` or the adaptive entropy is
    on; RLOO logs the entropy only; DPO and KTO detach it for their logs. Any other trainer
    keeps the entropy's gradient (exact whatever its loss does)."""
    import trl

    if isinstance(trainer, trl.GRPOTrainer):
        return bool(getattr(trainer, "_entropy_bonus_enabled", True))
    return not isinstance(trainer, trl.RLOOTrainer | trl.DPOTrainer | trl.KTOTrainer)


def _resolve_backend(trainer, inner, backend_options):
    from tile_pass.integrations.transformers import backend_of

    found = backend_of(trainer)
    if found is not None:
        if inner is not None or backend_options:
            raise ValueError(
                "this trainer's model is already compiled with tile_pass (compile_for_training): its "
                "backend is used for TRL's head too; pass no inner or backend options"
            )
        return found
    return backend_from(inner, backend_options)


def _rewrap_for_accelerate(trainer, module, forward) -> None:
    """Put ``forward`` inside the autocast + fp32-output wrapper that accelerate's
    ``prepare_model`` put around TRL's forward (a reference model under mixed precision)."""
    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.modeling import get_mixed_precision_context_manager

    accelerator = trainer.accelerator
    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    module._original_forward = forward
    module.forward = types.MethodType(convert_outputs_to_fp32(autocast(forward.__func__)), module)


def _hand_rl_head(trainer, inner, backend_options) -> None:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "DeepSpeed ZeRO-3 partitions the lm_head weight outside its module's forward; TRL's head "
            "gathers it around its own backward, a compiled backward cannot: keep TRL's head"
        )
    found = []  # (module, TRL's forward, whether accelerate wraps it)
    for root in models_of(trainer):
        for module in root.modules():
            own = module.__dict__.get("forward")
            wrapped = module.__dict__.get("_original_forward")
            if own is not None and _is_trl_fused_forward(own):
                found.append((module, own, False))
            elif wrapped is not None and _is_trl_fused_forward(wrapped) and hasattr(trainer, "accelerator"):
                found.append((module, wrapped, True))
            elif any(_is_trl_fused_forward(f) for f in forward_chain(module)):
                raise RuntimeError(
                    f"TRL's fused head on {type(module).__name__} is wrapped by another forward: call "
                    "hand_head_to_tile_pass after building the trainer and before trainer.train()"
                )
    if not found:
        raise ValueError("this trainer's models have no TRL fused LM head to hand to tile_pass")
    backend = _resolve_backend(trainer, inner, backend_options)
    entropy_grad = _entropy_needs_grad(trainer)
    # every forward is built before any is installed: a refusal leaves the trainer as it was
    forwards = [
        _tiled_forward(module, fused, backend, entropy_grad, f"trl_head_{i}_{type(module).__name__}")
        for i, (module, fused, _) in enumerate(found)
    ]
    for (module, _, under_accelerate), forward in zip(found, forwards, strict=True):
        if under_accelerate:
            _rewrap_for_accelerate(trainer, module, forward)
        else:
            module.forward = forward


def _hand_sft_head(trainer, inner, backend_options) -> None:
    import transformers

    from tile_pass.integrations.transformers import backend_of, compile_for_training

    if getattr(trainer.args, "loss_type", "nll") not in ("nll", "chunked_nll"):
        raise ValueError(
            f"loss_type={trainer.args.loss_type!r} weights each token by its probability, which TRL "
            "computes from its fused head; only the plain 'nll' loss can be handed to tile_pass"
        )
    restored = 0
    for root in models_of(trainer):
        for module in root.modules():
            fused = module.__dict__.get("forward")
            if fused is None or not _is_trl_fused_forward(fused):
                if any(_is_trl_fused_forward(f) for f in forward_chain(module)):
                    raise RuntimeError(
                        f"TRL's fused head on {type(module).__name__} is wrapped by another forward "
                        "(accelerate's, after trainer.train() started): call hand_head_to_tile_pass "
                        "before trainer.train()"
                    )
                continue
            original = _original_forward(fused)
            if isinstance(original, types.MethodType) and original.__self__ is module:
                if original.__func__ is getattr(type(module), "forward", None):
                    del module.forward  # the class forward was there before TRL
                else:
                    module.forward = original  # an instance forward (compile_for_training's)
            else:
                module.forward = original
            restored += 1
    if not restored:
        raise ValueError("this trainer's model has no TRL fused LM head to hand back")
    if inner is not None and backend_of(trainer) is None:
        compile_for_training(trainer.model, inner, **backend_options)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {**inputs, "use_cache": False}
        return transformers.Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    trainer.compute_loss = types.MethodType(compute_loss, trainer)


def hand_head_to_tile_pass(trainer, inner: Any = None, **backend_options: Any):
    """Hand a TRL trainer's LM head to tile_pass; returns the trainer.

    Call it after building the trainer and before ``trainer.train()``. The backend is the one
    :func:`tile_pass.integrations.transformers.compile_for_training` compiled the model's forward
    with, if it ran before the trainer was built; else the one ``inner`` and ``backend_options`` ask
    for, as every integration takes them (:mod:`tile_pass.integrations._head`; ``inner`` defaults
    to ``"inductor"``; a ready :class:`tile_pass.Backend` is used as is).

    * ``SFTTrainer``: puts back the ``forward`` TRL's ``add_fused_lm_head`` replaced and makes
      ``trainer.compute_loss`` the model's own loss, as ``transformers.Trainer`` computes it
      (``model(**inputs, num_items_in_batch=...)``, ``use_cache=False``). The loss is SFT's
      ``"nll"`` loss (TRL's head at temperature 1 computes the same); SFT's ``entropy`` and
      ``mean_token_accuracy`` logs are lost, ``loss_type="dft"`` is refused. The restored forward
      is tiled if it was compiled with tile_pass (``compile_for_training`` before the trainer, or
      ``inner`` given here).
    * ``GRPOTrainer``, ``RLOOTrainer``, ``DPOTrainer``, ``KTOTrainer`` (and any trainer whose
      model or ``ref_model`` carries TRL's head): TRL's forward on the policy and the reference
      model is replaced by one that computes the same ``FusedCausalLMOutput`` (loss, log-probs
      and the fields the trainer asked TRL for, with its temperature) from the model's own
      ``lm_head``, in one graph compiled with the backend, which tiles it: the policy with
      gradients, the reference model and the no-grad passes forward only. The entropy keeps its
      gradient where the trainer's loss uses it (GRPO's ``entropy_coef``); where the trainer only
      logs it, it is detached, as TRL's own head leaves its gradient unused.
      ``tile_pass.integrations.transformers.report(trainer)`` shows what was tiled and names the
      handed head in its hints.
    """
    import trl

    if isinstance(trainer, trl.SFTTrainer):
        _hand_sft_head(trainer, inner, backend_options)
    else:
        _hand_rl_head(trainer, inner, backend_options)
    return trainer


__all__ = [
    "fused_lm_head_hint",
    "fused_lm_head_modules",
    "hand_head_to_tile_pass",
    "per_token_outputs",
    "tiled_lm_head_modules",
]
