"""Which modules of a model or trainer carry TRL's fused LM head, or tile_pass's replacement
of it: what :func:`tile_pass.integrations.transformers.report` names in its hints, apart
from :mod:`tile_pass.integrations.trl` (which hands the head over and needs the
transformers integration's compile) so neither imports the other back."""

from __future__ import annotations

from tile_pass.integrations._forward import code_of, forward_chain, models_of

#: what TRL calls the forward it installs (``add_fused_lm_head.<locals>._fused_forward``)
_TRL_FORWARD = "_fused_forward"


def _is_trl_fused_forward(f) -> bool:
    code = code_of(f)
    if code is None:
        return False
    path = code.co_filename.replace("\\", "/")
    return code.co_name == _TRL_FORWARD and "/trl/" in path


def _tiled_head_of(f):
    """The description tile_pass's replacement of TRL's head carries, or ``None``."""
    return getattr(getattr(f, "__func__", f), "_tile_pass_trl_head", None)


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


def tiled_lm_head_modules(obj) -> list[str]:
    """Names of the modules whose TRL head :func:`hand_head_to_tile_pass` handed to tile_pass, with
    what each computes, e.g. ``["model (LlamaForCausalLM): log_probs, entropy (with gradient)"]``."""
    found = []
    for root_name, root in zip(("model", "ref_model"), models_of(obj), strict=False):
        for name, module in root.named_modules():
            described = next((d for f in forward_chain(module) if (d := _tiled_head_of(f))), None)
            if described:
                where = f"{root_name}.{name}" if name else root_name
                found.append(f"{where} ({type(module).__name__}): {described}")
    return found


def fused_lm_head_hint(obj) -> str:
    """A sentence naming TRL's head where ``obj`` has one (or the head tile_pass took over from
    it), else ``""``."""
    modules = fused_lm_head_modules(obj)
    if modules:
        return (
            f"TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) replaced the forward of "
            f"{', '.join(modules)}: TRL's trainers call it with fused_lm_head=True and it computes "
            "per-token log-probs in TRL's own chunks, so no linear + cross_entropy reaches tile_pass. "
            "TRL 1.16 has no option to turn it off; "
            "tile_pass.integrations.trl.hand_head_to_tile_pass(trainer), called before trainer.train(), "
            "hands it to tile_pass: for an SFTTrainer it restores the "
            "model's forward and loss, for GRPO/RLOO/DPO/KTO it computes the same per-token outputs "
            "(log-probs, entropies, ...) from the model's own lm_head in one graph that tile_pass tiles"
        )
    tiled = tiled_lm_head_modules(obj)
    if tiled:
        return (
            "TRL's fused LM head was handed to tile_pass (hand_head_to_tile_pass): "
            + "; ".join(tiled)
            + ". Each fused_lm_head=True call is one compiled graph (backbone, lm_head, per-token "
            "outputs); a graph without a REWRITTEN entry above ran untiled, for the reason given"
        )
    return ""
