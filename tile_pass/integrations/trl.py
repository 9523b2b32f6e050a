"""TRL: its trainers bring their own chunked LM head, which hides the head from tile_pass.

TRL (1.16) ``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``, ``KTOTrainer`` and ``RLOOTrainer``
call ``trl.trainer.utils.add_fused_lm_head(model)`` when they are built. It replaces the
model's ``forward`` (an instance attribute) with one that, called with ``fused_lm_head=True``
(as the trainers' losses do), runs the backbone and then TRL's ``ChunkedLogProbFunction``:
per-token log-probabilities computed in chunks, never the ``[tokens, vocab]`` logits. It
already does what tile_pass does, with its own kernel; no ``linear + cross_entropy`` is left
for tile_pass to find, and its report says only that no candidate was found.

TRL 1.16 has no setting that turns the head off: the patch is unconditional. For
``SFTTrainer`` the model's own loss is the same loss (at temperature 1), so
:func:`hand_head_to_tile_pass` restores the forward TRL replaced and makes the trainer
compute the model's own loss, which tile_pass then tiles. The RL trainers (GRPO, RLOO, DPO,
KTO) build their losses from TRL's per-token log-probabilities and entropies; there is
nothing to hand back there.

Detection needs no import of TRL; :func:`hand_head_to_tile_pass` imports it.
"""

from __future__ import annotations

import types

from tile_pass.integrations._forward import code_of, forward_chain, models_of

#: what TRL calls the forward it installs (``add_fused_lm_head.<locals>._fused_forward``)
_TRL_FORWARD = "_fused_forward"


def _is_trl_fused_forward(f) -> bool:
    code = code_of(f)
    if code is None:
        return False
    path = code.co_filename.replace("\\", "/")
    return code.co_name == _TRL_FORWARD and "/trl/" in path


def fused_lm_head_modules(obj) -> list[str]:
    """Names of the modules (in a model, or a trainer's ``model`` and ``ref_model``) whose
    ``forward`` is TRL's fused LM head, e.g. ``["model (LlamaForCausalLM)"]``; ``[]`` if none."""
    found = []
    for root_name, root in zip(("model", "ref_model"), models_of(obj), strict=False):
        for name, module in root.named_modules():
            if any(_is_trl_fused_forward(f) for f in forward_chain(module)):
                where = f"{root_name}.{name}" if name else root_name
                found.append(f"{where} ({type(module).__name__})")
    return found


def fused_lm_head_hint(obj) -> str:
    """A sentence naming TRL's head where ``obj`` has one, else ``""``."""
    modules = fused_lm_head_modules(obj)
    if not modules:
        return ""
    return (
        f"TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) replaced the forward of "
        f"{', '.join(modules)}: TRL's trainers call it with fused_lm_head=True and it computes "
        "per-token log-probs in TRL's own chunks, so no linear + cross_entropy reaches tile_pass "
        "(TRL's head already avoids the whole logits). TRL 1.16 has no option to turn it off; for an "
        "SFTTrainer, tile_pass.integrations.trl.hand_head_to_tile_pass(trainer) restores the model's "
        "forward and loss so tile_pass tiles the head. GRPO/RLOO/DPO/KTO build their losses from TRL's "
        "per-token outputs and keep TRL's head."
    )


def _original_forward(fused: types.MethodType):
    """The forward TRL wrapped: its closure's ``original_forward``."""
    func = fused.__func__
    cells = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=True))
    return cells["original_forward"].cell_contents


def hand_head_to_tile_pass(trainer):
    """Give an ``SFTTrainer``'s LM head back to the model, and so to tile_pass; returns it.

    Call it after building the trainer and before ``trainer.train()``. It

    * puts back the ``forward`` that TRL's ``add_fused_lm_head`` replaced (the one
      :func:`tile_pass.integrations.transformers.compile_for_training` compiled, if it ran
      before the trainer was built),
    * makes ``trainer.compute_loss`` the model's own loss, as ``transformers.Trainer``
      computes it (``model(**inputs, num_items_in_batch=...)``, with ``use_cache=False`` as
      SFT sets it).

    The loss is SFT's ``"nll"`` loss (TRL's head at temperature 1 computes the same). What
    is lost: SFT's ``entropy`` and ``mean_token_accuracy`` metrics (TRL computes them from
    its fused outputs) and ``loss_type="dft"``, which is refused here.
    """
    import transformers
    import trl

    if not isinstance(trainer, trl.SFTTrainer):
        raise TypeError(
            f"hand_head_to_tile_pass supports trl.SFTTrainer, got {type(trainer).__name__}: the RL "
            "trainers' losses are built from TRL's per-token log-probs and entropies, which need "
            "TRL's fused head"
        )
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

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {**inputs, "use_cache": False}
        return transformers.Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    trainer.compute_loss = types.MethodType(compute_loss, trainer)
    return trainer


__all__ = ["fused_lm_head_hint", "fused_lm_head_modules", "hand_head_to_tile_pass"]
