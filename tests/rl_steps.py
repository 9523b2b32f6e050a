"""One micro-batch of the RL and preference frameworks' training steps, composed as each
framework composes them and calling the framework's own functions where it installs.

The tests (``tests/test_rl_frameworks.py``) compile these steps unchanged and compare them
with float64 eager; a step is a function ``step(h, w, d) -> loss`` of the hidden states ``h``,
the LM head's weight ``w`` (both trained) and a dict ``d`` of the batch's other tensors (token
ids, masks, advantages, the rollout's and the reference model's log-probabilities), so that
the only ``[N, V]`` tensor of a step is the one its head makes.

Where a framework's loss modules cannot be imported as published (verl's package
``__init__`` imports Ray for its distributed protocol; OpenRLHF's ``openrlhf.models``
imports flash-attn for ring attention), only those package ``__init__`` files are skipped:
the loss modules themselves are imported and called as they are. verl's profiler module
imports Ray's decorators at import time and never calls them on the loss path; when Ray is
absent a placeholder stands in for it during that import only.

Frameworks that do not install here are written in their style from their sources, and
say so: NeMo-RL (the registry's ``nemo-rl`` is an empty 0.0.0 placeholder) and torchtune's
GRPO losses (``torchtune.dev.grpo`` is not in the 0.6.1 wheel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable

import torch

B, T, H, V = 2, 16, 32, 640  # two sequences of 16 tokens, a 640-token vocabulary
if _size := os.environ.get("TILE_PASS_RL_STEP_SIZE"):  # "T,H,V": scripts/rl_memory.py's larger batch
    T, H, V = (int(n) for n in _size.split(","))
PROMPT = 6  # the prompt's length; the response is the last T - PROMPT tokens
R = T - PROMPT
TEMPERATURE = 0.7


# ------------------------------------------------------------------------------ importing


def _bare_package(name: str) -> None:
    """``name`` as a namespace for its submodules, its ``__init__`` not run."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[name] = module


class _Placeholder(types.ModuleType):
    """Any attribute is another placeholder; a call on a function (a decorator) returns it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name == self.root or name.startswith(self.root + "."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _placeholder_if_absent(root: str):
    """While importing: ``root`` resolves to a placeholder if it is not installed; afterwards it
    is absent again for every other importer."""
    spec = importlib.util.find_spec(root)
    if spec is not None and spec.origin is not None:  # installed (not a bare namespace directory)
        yield
        return
    finder = _PlaceholderFinder(root)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            del sys.modules[name]


@functools.cache
def verl() -> types.SimpleNamespace:
    """verl's torch_functional, core_algos and actor config (raises ImportError if absent)."""
    if importlib.util.find_spec("verl") is None:
        raise ImportError("verl is not installed")
    _bare_package("verl")
    with _placeholder_if_absent("ray"):
        import verl.trainer.ppo.core_algos as core_algos
        import verl.utils.torch_functional as verl_F
        from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig
    return types.SimpleNamespace(
        F=verl_F, core_algos=core_algos, ActorConfig=FSDPActorConfig, PolicyLossConfig=PolicyLossConfig
    )


@functools.cache
def openrlhf() -> types.SimpleNamespace:
    """OpenRLHF's ``models.utils`` and ``models.loss`` (raises ImportError if absent)."""
    if importlib.util.find_spec("openrlhf") is None:
        raise ImportError("openrlhf is not installed")
    import openrlhf  # noqa: F401  (its own __init__ is empty)

    _bare_package("openrlhf.models")
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils

    return types.SimpleNamespace(utils=utils, loss=loss)


@functools.cache
def torchtune() -> types.SimpleNamespace:
    import torchtune.rlhf as rlhf
    from torchtune.rlhf.loss import DPOLoss, PPOLoss

    return types.SimpleNamespace(rlhf=rlhf, DPOLoss=DPOLoss, PPOLoss=PPOLoss)


# ---------------------------------------------------------------------------------- data


def batch(device="cpu", dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Hidden states ``[B, T, H]``, the head ``[V, H]``, and the rest of one micro-batch.

    Sequence 1 ends two tokens early (right padding): its attention mask and response mask
    are zero there. Advantages are per token (verl, OpenRLHF) with per-sequence values
    (``seq_advantages``, torchtune's GRPO); the rollout's log-probabilities sit near the
    policy's so that some ratios are clipped and some not.
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.int64)
    attention[1, T - 2 :] = 0
    response_mask = attention[:, PROMPT:].clone()
    with torch.no_grad():
        lp = torch.log_softmax((h @ w.t())[:, PROMPT - 1 : -1] / TEMPERATURE, -1)
        lp = lp.gather(-1, ids[:, PROMPT:, None]).squeeze(-1)
    old = lp + 0.3 * torch.randn(B, R, generator=g)
    ref = lp + 0.5 * torch.randn(B, R, generator=g)
    rollout = old + 0.1 * torch.randn(B, R, generator=g)
    seq_adv = torch.tensor([1.0, -0.7])
    adv = seq_adv[:, None] * (1 + 0.2 * torch.randn(B, R, generator=g))
    floats = dict(old_log_probs=old, ref_log_probs=ref, rollout_log_probs=rollout, advantages=adv,
                  seq_advantages=seq_adv)  # fmt: skip
    ints = dict(input_ids=ids, attention_mask=attention, response_mask=response_mask)
    d = {k: v.to(device, dtype) for k, v in floats.items()}
    d.update({k: v.to(device) for k, v in ints.items()})
    return h.to(device, dtype), w.to(device, dtype), d


def pairs(device="cpu", dtype=torch.float32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A preference batch: chosen rows then rejected rows (``2 * B`` sequences of ``T``),
    labels ``-100`` over each prompt, the reference model's per-sequence log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2 * B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, (2 * B, T), generator=g)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    labels[3, T - 3 :] = -100  # a shorter rejected answer
    ref = -torch.rand(2 * B, generator=g) * 20 - 40
    h_ref = h + 0.1 * torch.randn(2 * B, T, H, generator=g)  # the reference model's hidden states
    w_ref = w + 0.05 * torch.randn(V, H, generator=g)
    d = dict(labels=labels.to(device), input_ids=ids.to(device), ref_logps=ref.to(device, dtype),
             h_ref=h_ref.to(device, dtype), w_ref=w_ref.to(device, dtype))  # fmt: skip
    return h.to(device, dtype), w.to(device, dtype), d


# -------------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class Step:
    framework: str
    name: str
    fn: Callable
    data: Callable = batch
    heads: int = 1  # projections to the vocabulary in the step
    #: where the step is not the framework's own code: what it is written from
    written_from: str = ""


def _verl_config(loss_mode="vanilla", agg="token-mean", **policy):
    v = verl()
    return v.ActorConfig(
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=B,
        loss_agg_mode=agg,
        entropy_coeff=0.01,
        kl_loss_coef=0.05,
        policy_loss=v.PolicyLossConfig(loss_mode=loss_mode, **policy),
    )


def _verl_losses(v, log_prob, entropy, d, config, kl_type):
    """The actor's loss on the response tokens: the registered policy loss, the entropy bonus
    and the KL loss, each aggregated by ``agg_loss`` in the configured mode."""
    mask = d["response_mask"].bool()
    agg = config.loss_agg_mode
    policy_loss_fn = v.core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)
    pg_loss, _ = policy_loss_fn(
        old_log_prob=d["old_log_probs"], log_prob=log_prob, advantages=d["advantages"],
        response_mask=mask, loss_agg_mode=agg, config=config,
        rollout_is_weights=None,
    )  # fmt: skip
    loss = pg_loss
    if entropy is not None:
        entropy_loss = v.core_algos.agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=agg)
        loss = loss - config.entropy_coeff * entropy_loss
    if kl_type is not None:
        kld = v.core_algos.kl_penalty(logprob=log_prob, ref_logprob=d["ref_log_probs"], kl_penalty=kl_type)
        loss = (
            loss
            + v.core_algos.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg) * config.kl_loss_coef
        )
    return loss


def verl_padded(h, w, d, *, v, config, entropy="plain", kl_type=None):
    """verl's FSDP actor, padded path (``use_remove_padding=False``): the model's logits over
    the whole sequence, the temperature divided in place, the response's logits sliced out,
    then ``logprobs_from_logits`` and ``entropy_from_logits`` on them."""
    logits = h @ w.t()  # the model's lm_head: [B, T, V]
    logits.div_(TEMPERATURE)
    logits = logits[:, -R - 1 : -1, :]  # (bsz, response_length, vocab_size)
    log_prob = v.F.logprobs_from_logits(logits, d["input_ids"][:, -R:])
    ent = None
    if entropy == "plain":
        ent = v.F.entropy_from_logits(logits)
    return _verl_losses(v, log_prob, ent, d, config, kl_type)


def verl_rmpad(h, w, d, *, v, config, entropy="plain", kl_type=None, in_place=True):
    """verl's FSDP actor, remove-padding path: the model runs on the packed valid tokens
    ``[1, nnz]``; the logits are ``[nnz, V]``, divided by the temperature (in place, as the
    actor's micro-batch forward does; ``in_place=False``: as the 0.9 engine does, by a
    per-token temperature), the log-probabilities of the rolled ids, the entropy (plain or
    chunked), then scattered back to ``[B, T]`` and the response sliced out."""
    indices = d["rmpad_indices"]  # flash-attn's unpad_input: the valid tokens' positions
    ids_rmpad = d["input_ids"].flatten()[indices]
    ids_rolled = torch.roll(ids_rmpad, shifts=-1, dims=0)
    h_rmpad = h.reshape(B * T, H)[indices].unsqueeze(0)  # the packed sequence, (1, nnz, H)
    logits_rmpad = (h_rmpad @ w.t()).squeeze(0)  # (nnz, vocab_size)
    if in_place:
        logits_rmpad.div_(TEMPERATURE)
    else:
        temperature = torch.full_like(ids_rmpad, TEMPERATURE, dtype=torch.float32)
        logits_rmpad = logits_rmpad / temperature.unsqueeze(-1).clamp(min=1e-8).to(logits_rmpad.dtype)
    log_probs = v.F.logprobs_from_logits(logits_rmpad, ids_rolled)
    ent = None
    if entropy == "plain":
        ent = v.F.entropy_from_logits(logits_rmpad)
    elif entropy == "chunked":
        ent = v.F.entropy_from_logits_with_chunking(logits_rmpad, chunk_size=8)

    def pad(values):  # flash-attn's pad_input: a zero [B * T] written at the packed positions
        full = values.new_zeros(B * T)
        full[indices] = values
        return full.view(B, T)[:, -R - 1 : -1]

    return _verl_losses(v, pad(log_probs), None if ent is None else pad(ent), d, config, kl_type)


def _with_rmpad_indices(data):
    def make(*args, **kwargs):
        h, w, d = data(*args, **kwargs)
        d["rmpad_indices"] = d["attention_mask"].flatten().nonzero().squeeze(-1)
        return h, w, d

    return make


_POLICY_EXTRA = {"dro": dict(dro_beta=0.1)}


def verl_steps() -> list[Step]:
    v = verl()
    steps = []
    rmpad_batch = _with_rmpad_indices(batch)
    for mode in v.core_algos.POLICY_LOSS_REGISTRY:
        config = _verl_config(mode, **_POLICY_EXTRA.get(mode, {}))
        steps.append(Step("verl", f"padded-{mode}", functools.partial(verl_padded, v=v, config=config)))
    for agg in (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ):
        config = _verl_config("vanilla", agg)
        steps.append(Step("verl", f"padded-agg-{agg}", functools.partial(verl_padded, v=v, config=config)))
    for kl in ("k1", "abs", "k2", "k3", "k1+", "k3+"):
        config = _verl_config()
        steps.append(
            Step("verl", f"padded-kl-{kl}", functools.partial(verl_padded, v=v, config=config, kl_type=kl))
        )
    padded = functools.partial(verl_padded, v=v, config=_verl_config())
    rmpad = functools.partial(verl_rmpad, v=v, config=_verl_config())
    steps += [
        Step("verl", "padded-no-entropy", functools.partial(padded, entropy=None)),
        Step("verl", "rmpad", rmpad, rmpad_batch),
        Step("verl", "rmpad-chunked-entropy", functools.partial(rmpad, entropy="chunked"), rmpad_batch),
        Step("verl", "rmpad-kl-k3", functools.partial(rmpad, kl_type="k3"), rmpad_batch),
        Step("verl", "rmpad-engine-temperature", functools.partial(rmpad, in_place=False), rmpad_batch),
    ]  # fmt: skip
    return steps


# ------------------------------------------------------------------------------ OpenRLHF


def openrlhf_actor(
    h, w, d, *, o, policy_loss_type="ppo", entropy=True, kl="k3", dual_clip=None, temperature_in_helper=False
):
    """OpenRLHF's ``Actor.forward`` (0.11.2, without sample packing) and its PPO trainer's loss:
    the logits in float32 divided by the temperature in place, ``compute_entropy`` of them,
    ``log_probs_from_logits`` of the rolled sequence, the last position dropped, the action
    log-probabilities sliced out and masked; then ``PolicyLoss``, the KL to the reference
    (``compute_approx_kl``) and the entropy bonus as masked means. ``temperature_in_helper``:
    the temperature given to ``log_probs_from_logits`` instead, on ``logits[:, :-1]`` (its own
    in-place division of that view), and the entropy of the logits after it, as older actors did."""
    logits = (h @ w.t()).to(torch.float32)  # output["logits"]
    if temperature_in_helper:
        log_probs = o.utils.log_probs_from_logits(
            logits[:, :-1], d["input_ids"][:, 1:], temperature=TEMPERATURE
        )
        ent = o.utils.compute_entropy(logits)[:, :-1] if entropy else None
    else:
        logits.div_(TEMPERATURE)
        ent = o.utils.compute_entropy(logits)[:, :-1] if entropy else None  # itself under @torch.compile
        rolled = torch.roll(d["input_ids"], shifts=-1, dims=1)
        log_probs = o.utils.log_probs_from_logits(logits, rolled)[:, :-1]
    mask = d["response_mask"]
    action_log_probs = log_probs[:, -R:] * mask.float()
    policy = o.loss.PolicyLoss(0.2, 0.28, dual_clip=dual_clip, policy_loss_type=policy_loss_type)
    loss, *_ = policy(action_log_probs, d["old_log_probs"], d["advantages"], action_mask=mask)
    if kl is not None:
        kld = o.utils.compute_approx_kl(action_log_probs, d["ref_log_probs"], kl_estimator=kl)
        loss = loss + 0.01 * o.utils.masked_mean(kld, mask, dim=-1).mean()
    if ent is not None:
        loss = loss - 0.01 * o.utils.masked_mean(ent[:, -R:], mask)
    return loss


def _openrlhf_sequence_logps(o, logits, labels, average=False):
    """OpenRLHF's DPO trainer: per-sequence log-probabilities of the labelled tokens."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[~loss_mask] = 0
    per_token = o.utils.log_probs_from_logits(logits, labels)
    if average:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def openrlhf_dpo(h, w, d, *, o):
    """OpenRLHF's DPO trainer: chosen and rejected concatenated, one forward, ``DPOLoss``."""
    logits = h @ w.t()
    logps = _openrlhf_sequence_logps(o, logits, d["labels"])
    chosen, rejected = logps[:B], logps[B:]
    ref = d["ref_logps"]
    loss, chosen_reward, rejected_reward = o.loss.DPOLoss(beta=0.1)(chosen, rejected, ref[:B], ref[B:])
    return loss


def openrlhf_steps() -> list[Step]:
    actor = functools.partial(openrlhf_actor, o=openrlhf())
    return [
        Step("openrlhf", "ppo-k3-entropy", actor),
        Step("openrlhf", "ppo-dual-clip-k1", functools.partial(actor, kl="k1", dual_clip=3.0)),
        Step("openrlhf", "gspo-k2", functools.partial(actor, policy_loss_type="gspo", kl="k2")),
        Step("openrlhf", "ppo-no-entropy", functools.partial(actor, entropy=False)),
        Step("openrlhf", "ppo-temperature-in-helper", functools.partial(actor, temperature_in_helper=True)),
        Step("openrlhf", "dpo", functools.partial(openrlhf_dpo, o=openrlhf()), pairs),
    ]


# ----------------------------------------------------------------------------- torchtune


def torchtune_ppo(h, w, d, *, t):
    """torchtune's PPO recipe (``ppo_full_finetune_single_device``), the policy's half of
    ``_ppo_step``: the logits truncated to the response, ``logits_to_logprobs`` at the
    temperature, padded positions set to 1.0 in place, and ``PPOLoss`` with the padding masks
    negated (``~``). The value head's terms are given as tensors."""
    pad = d["response_mask"] == 0  # response_padding_masks
    pi_logits = h @ w.t()
    pi_logits = t.rlhf.truncate_sequence_for_logprobs(pi_logits, PROMPT)
    pi_logprobs = t.rlhf.logits_to_logprobs(pi_logits, d["input_ids"][:, PROMPT:], TEMPERATURE)
    pi_logprobs[pad] = 1.0
    values = d["advantages"] * 0.5
    loss, *_ = t.PPOLoss()(d["old_log_probs"], pi_logprobs, d["advantages"], values.detach(), values,
                           d["ref_log_probs"], padding_masks=~pad, value_padding_masks=~pad)  # fmt: skip
    return loss


def torchtune_dpo(h, w, d, *, t, metrics=False, reference_forward=False):
    """torchtune's DPO recipe (``lora_dpo_single_device``): ``concatenated_forward`` with
    ``get_batch_log_probs``, ``DPOLoss`` and the mean of its losses; ``metrics=True`` also
    returns the detached rewards' accuracy as the recipe logs it. ``reference_forward=True``:
    the reference log-probabilities from a second forward after the policy's, under
    ``torch.no_grad()`` (the recipe's ``disable_adapter``), through its own frozen head."""
    all_logits = h @ w.t()
    all_log_probs = t.rlhf.get_batch_log_probs(all_logits, d["labels"])
    chosen, rejected = all_log_probs[:B], all_log_probs[B:]
    if reference_forward:
        with torch.no_grad():
            ref = t.rlhf.get_batch_log_probs(d["h_ref"] @ d["w_ref"].t(), d["labels"])
    else:
        ref = d["ref_logps"]
    losses, chosen_rewards, rejected_rewards = t.DPOLoss(beta=0.1)(chosen, rejected, ref[:B], ref[B:])
    loss = losses.mean()
    if metrics:
        return loss, (chosen_rewards > rejected_rewards).float().mean()
    return loss


def _batched_logits_to_logprobs(t, logits, sequences, temperature, chunk_size):
    """torchtune's ``rlhf.batched_logits_to_logprobs`` (not in the 0.6.1 wheel), in its form:
    ``logits_to_logprobs`` over chunks of ``chunk_size`` sequences, concatenated."""
    return torch.cat(
        [
            t.rlhf.logits_to_logprobs(logits[i : i + chunk_size], sequences[i : i + chunk_size], temperature)
            for i in range(0, logits.shape[0], chunk_size)
        ]
    )


def torchtune_grpo(h, w, d, *, t, form="token", chunk_size=None):
    """torchtune's GRPO recipe (``dev/grpo_full_finetune_distributed``, ``grpo_step``), written
    in its style from its source: ``torchtune.dev.grpo`` (the losses) and
    ``rlhf.batched_logits_to_logprobs`` are not in the 0.6.1 wheel. The logits truncated to the
    response, their log-probabilities (per chunk of sequences with ``chunk_size``, else the
    installed ``rlhf.logits_to_logprobs``), padded positions set to 1.0 in place, the masks
    negated, then the loss: per-token clipped ratios with a k3 KL (``token``), ratios of whole
    completions (``completion``), or TRL's single-step form (``simple``)."""
    pad = d["response_mask"] == 0
    logits = t.rlhf.truncate_sequence_for_logprobs(h @ w.t(), PROMPT)
    responses = d["input_ids"][:, PROMPT:]
    if chunk_size is None:
        pi = t.rlhf.logits_to_logprobs(logits, responses, TEMPERATURE)
    else:
        pi = _batched_logits_to_logprobs(t, logits, responses, TEMPERATURE, chunk_size)
    pi[pad] = 1.0
    mask = ~pad
    old, ref, adv = d["old_log_probs"], d["ref_log_probs"], d["seq_advantages"]
    if form == "completion":
        pi, old, ref = ((x * mask).sum(-1) for x in (pi, old, ref))
        ratios = torch.exp(pi - old)
        policy = torch.minimum(adv * ratios.clamp(0.9, 1.1), adv * ratios).mean()
        kl = torch.exp(ref - pi) - (ref - pi) - 1
        return -(policy - 0.1 * kl.mean())
    adv = adv[:, None]
    if form == "token":
        kl = torch.exp(ref - pi) - (ref - pi) - 1
        ratios = torch.exp(pi - old)
        policy = torch.minimum(adv * ratios.clamp(0.9, 1.1), adv * ratios)
        return -(t.rlhf.masked_mean(policy, mask) - 0.1 * t.rlhf.masked_mean(kl, mask))
    kl = torch.exp(ref.detach() - pi) - (ref.detach() - pi) - 1
    per_token = -(torch.exp(pi - pi.detach()) * adv - 0.1 * kl)
    return t.rlhf.masked_mean(per_token, mask, dim=1).mean()


def torchtune_steps() -> list[Step]:
    t = torchtune()
    written = "torchtune.dev.grpo (not in the 0.6.1 wheel), from its source"
    grpo = functools.partial(torchtune_grpo, t=t)
    return [
        Step("torchtune", "ppo", functools.partial(torchtune_ppo, t=t)),
        Step("torchtune", "dpo", functools.partial(torchtune_dpo, t=t), pairs),
        Step("torchtune", "dpo-reward-accuracy", functools.partial(torchtune_dpo, t=t, metrics=True), pairs),
        Step(
            "torchtune",
            "dpo-reference-forward",
            functools.partial(torchtune_dpo, t=t, metrics=True, reference_forward=True),
            pairs,
            heads=2,
        ),
        Step("torchtune", "grpo", grpo, written_from=written),
        Step("torchtune", "grpo-simple", functools.partial(grpo, form="simple"), written_from=written),
        Step(
            "torchtune", "grpo-completion", functools.partial(grpo, form="completion"), written_from=written
        ),
        Step(
            "torchtune", "grpo-batched-logprobs", functools.partial(grpo, chunk_size=1), written_from=written
        ),
    ]


# ------------------------------------------------------------------------------ NeMo-RL


def _masked_mean(values, mask, normalizer=None):
    """NeMo-RL's ``masked_mean``: over the mask, or divided by a global token count."""
    if normalizer is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum() / normalizer


def _full(response_values):
    """A per-response-token tensor laid over the whole sequence, as NeMo-RL's data dict holds it."""
    return torch.cat([response_values.new_zeros(B, PROMPT), response_values], dim=1)


class _TopKFilter(torch.autograd.Function):
    """A top-k filter of the logits as a custom autograd.Function (NeMo-RL filters the training
    logits as its sampler did, so that the log-probabilities match the rollout's): the kept
    logits pass, the others become -inf; the backward passes the kept positions' gradient."""

    @staticmethod
    def forward(ctx, logits, top_k):
        keep = logits >= torch.topk(logits, top_k, dim=-1).values[..., -1:]
        ctx.save_for_backward(keep)
        return logits.masked_fill(~keep, float("-inf"))

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.masked_fill(~keep, 0.0), None


def nemo_rl_clipped_pg(h, w, d, *, temperature=TEMPERATURE, metrics=True, top_k=None):
    """NeMo-RL's DTensor policy worker and ``ClippedPGLossFn``, written in its style from its
    source (``nemo-rl`` on the registry is an empty 0.0.0 placeholder). The worker: the logits
    in float32, divided by the generation temperature in place. The loss: its mismatch metric
    read with ``.item()`` before the logits are, next-token log-probabilities by ``log_softmax``
    of ``logits[:, :-1]`` and ``gather``, the k3 KL to the reference and the clipped ratio, each a
    masked mean normalised by the global token count, and the ratio metrics after (``metrics``)."""
    logits = (h @ w.t()).to(torch.float32)
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k is not None:  # the sampler's filter, applied to the training logits
        logits = _TopKFilter.apply(logits, top_k)
    token_mask = _full(d["response_mask"].to(h.dtype))[:, 1:]
    sample_mask = torch.ones(B, dtype=h.dtype, device=h.device)
    mask = token_mask * sample_mask.unsqueeze(-1)
    advantages, prev = _full(d["advantages"])[:, 1:], _full(d["old_log_probs"])[:, 1:]
    generation, reference = _full(d["rollout_log_probs"])[:, 1:], _full(d["ref_log_probs"])[:, 1:]
    valid_tokens = mask.sum()
    if metrics:  # token_mult_prob_error, before the logits are read
        _masked_mean(torch.exp(torch.abs(generation - prev) * mask), mask, valid_tokens).item()
    next_token_logits = logits.to(torch.float32)
    next_token_logprobs = torch.nn.functional.log_softmax(next_token_logits[:, :-1], dim=-1)
    curr = next_token_logprobs.gather(dim=-1, index=d["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    log_ratio = reference - curr  # k3
    kl = 0.01 * (torch.exp(log_ratio) - log_ratio - 1)
    kl = _masked_mean(kl, mask, valid_tokens)
    ratios = (curr - prev).exp()
    ratios_clamped = ratios.clamp(1.0 - 0.2, 1.0 + 0.28)
    clip_loss = torch.max(-advantages * ratios, -advantages * ratios_clamped)
    loss = _masked_mean(clip_loss, mask, valid_tokens) + kl
    if metrics:
        with torch.no_grad():
            _masked_mean(ratios.detach(), mask, valid_tokens).item()
    return loss


def nemo_rl_steps() -> list[Step]:
    written = "NeMo-RL ClippedPGLossFn (nemo-rl does not install), from its source"
    return [
        Step("nemo-rl", "clipped-pg", nemo_rl_clipped_pg, written_from=written),
        Step("nemo-rl", "clipped-pg-no-metrics", functools.partial(nemo_rl_clipped_pg, metrics=False),
             written_from=written),
        Step("nemo-rl", "clipped-pg-t1", functools.partial(nemo_rl_clipped_pg, temperature=1.0),
             written_from=written),
        Step("nemo-rl", "clipped-pg-top-k",
             functools.partial(nemo_rl_clipped_pg, metrics=False, top_k=V // 2), written_from=written),
    ]  # fmt: skip


def all_steps() -> list[Step]:
    steps = []
    for make in (verl_steps, openrlhf_steps, torchtune_steps, nemo_rl_steps):
        try:
            steps += make()
        except ImportError:
            continue
    return steps


def float64(data: tuple) -> tuple:
    h, w, d = data
    return h.double(), w.double(), {k: v.double() if v.is_floating_point() else v for k, v in d.items()}
