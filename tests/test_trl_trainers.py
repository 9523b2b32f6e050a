"""TRL's RL and preference trainers with their LM head handed to tile_pass, one line each:
``hand_head_to_tile_pass(trainer)``. Real ``GRPOTrainer`` / ``DPOTrainer`` / ``RLOOTrainer`` /
``KTOTrainer`` steps on a tiny Llama built from a config (offline tokenizer, no downloads,
``inner="aot_eager"``): ``report(trainer)`` says rewritten (policy and reference model), and every
logged metric and the ``lm_head`` weight after the steps equal the same run with TRL's own head
(float32, rtol 1e-4). SGD, so the weight after a step carries the gradient itself (AdamW's first
step is ``lr * sign(g)``)."""

from __future__ import annotations

import math

import pytest
import torch

import tile_pass

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
    pytest.skip(
        "this TRL has no fused LM head (add_fused_lm_head arrived in the 1.x series)", allow_module_level=True
    )
transformers.logging.set_verbosity_error()

from tile_pass.integrations.transformers import report  # noqa: E402
from tile_pass.integrations.trl import (  # noqa: E402
    fused_lm_head_modules,
    hand_head_to_tile_pass,
    per_token_outputs,
    tiled_lm_head_modules,
)

VOCAB = 512
#: logged values that are not the model's (wall-clock time)
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def tiny_tokenizer():
    """One word per id; the special tokens are not prefixes of words (an eos "t1" would split "t10")."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def words(start, n):
    return " ".join(f"t{i}" for i in range(start, start + n))


def reward(completions, **kwargs):
    """Varies with the sampled tokens, so the advantages (and the gradients) are not zero."""
    return [float(sum(int(w[1:]) for w in c.split() if w.startswith("t")) % 7) for c in completions]


class Logs(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def common(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        logging_steps=1, seed=0, learning_rate=0.5, optim="sgd", disable_tqdm=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


def train_both(build, tmp_path, **handing):
    """``build(out_dir)`` -> (trainer, logs) twice: TRL's head, then handed to tile_pass."""
    runs = []
    for tiled in (False, True):
        trainer, logs = build(tmp_path / ("tiled" if tiled else "trl"))
        before = trainer.model.lm_head.weight.detach().clone()
        if tiled:
            assert fused_lm_head_modules(trainer)
            assert hand_head_to_tile_pass(trainer, **handing) is trainer
            assert fused_lm_head_modules(trainer) == []
        trainer.train()
        runs.append((trainer, logs.logs, before))
    return runs


def assert_same_run(trl_run, tiled_run, rtol=1e-4, atol=1e-6):
    (trl_trainer, trl_logs, before), (trainer, logs, before_tiled) = trl_run, tiled_run
    assert torch.equal(before, before_tiled)
    assert len(logs) == len(trl_logs) >= 2
    for step, (want, got) in enumerate(zip(trl_logs, logs, strict=True)):
        assert sorted(got) == sorted(want), step
        for key, value in want.items():
            if key in TIMING or not isinstance(value, int | float):
                continue
            assert math.isclose(got[key], value, rel_tol=rtol, abs_tol=atol), (step, key, got[key], value)
    weight, trl_weight = trainer.model.lm_head.weight.detach(), trl_trainer.model.lm_head.weight.detach()
    assert (trl_weight - before).abs().max() > 1e-2  # the steps moved the head
    torch.testing.assert_close(weight, trl_weight, rtol=rtol, atol=atol)
    torch.testing.assert_close(weight - before, trl_weight - before, rtol=rtol, atol=atol)


def assert_tiled(trainer, graphs_with_gradient_outputs):
    rep = report(trainer)
    assert rep.rewrites and not rep.skipped, str(rep)
    assert all("trl.py" in r.matmul_source and "F.linear" in r.form for r in rep.rewrites), str(rep)
    differentiable = sorted(r.form.count("differentiable") for r in rep.rewrites)
    assert differentiable[-len(graphs_with_gradient_outputs) :] == sorted(graphs_with_gradient_outputs), str(
        rep
    )
    assert 0 in differentiable, str(rep)  # a reference / no-grad pass: forward tiles only
    assert any("handed to tile_pass" in hint for hint in rep.hints), rep.hints
    return rep


# --- GRPO -------------------------------------------------------------------------------------


def test_grpo_trainer_with_kl_and_entropy_bonus_is_tiled_and_equals_trls_head(tmp_path):
    """GRPO with a reference model (beta > 0), an entropy bonus, temperature 0.7 and TRL's default
    gradient checkpointing: two steps, generation on CPU."""
    path = tmp_path / "tiny"
    tiny_llama().save_pretrained(path)  # GRPO builds its reference model from the policy's path
    prompts = datasets.Dataset.from_list([{"prompt": words(5 + j, 6)} for j in range(4)])

    def build(out):
        logs = Logs()
        args = trl.GRPOConfig(
            **common(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
            beta=0.04, entropy_coef=0.01, temperature=0.7,
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=str(path), reward_funcs=reward, args=args, train_dataset=prompts,
            processing_class=tiny_tokenizer(), callbacks=[logs],
        )  # fmt: skip
        return trainer, logs

    trl_run, tiled_run = train_both(build, tmp_path, inner="aot_eager", tile_tokens=8)
    trainer = tiled_run[0]
    assert tiled_lm_head_modules(trainer) == [
        "model (LlamaForCausalLM): log_probs, entropy (with gradient)",
        "ref_model (LlamaForCausalLM): log_probs",
    ]
    rep = assert_tiled(trainer, [2])  # the policy's log-probs and entropy, both differentiable
    assert any("softmax" in r.form and "div(0.7)" in r.form for r in rep.rewrites), str(rep)
    assert {"kl", "entropy", "policy_loss", "clip_ratio/region_mean", "reward"} <= set(tiled_run[1][0])
    assert tiled_run[1][1]["kl"] > 0  # the second step's policy has moved away from the reference
    assert_same_run(trl_run, tiled_run)


# --- DPO --------------------------------------------------------------------------------------


def preference_rows(n=4):
    return [
        {
            "prompt": words(3 + j, 4 + 2 * j),  # the second batch is longer: a dynamic-shape recompile
            "chosen": " " + words(40 + j, 4 + j % 2),
            "rejected": " " + words(90 + j, 3),
        }
        for j in range(n)
    ]


def dpo_builder(bf16=False):
    def build(out):
        logs = Logs()
        args = trl.DPOConfig(
            **common(out, bf16=bf16), per_device_train_batch_size=2, gradient_checkpointing=False
        )
        trainer = trl.DPOTrainer(
            model=tiny_llama(), ref_model=tiny_llama(), args=args,
            train_dataset=datasets.Dataset.from_list(preference_rows()), processing_class=tiny_tokenizer(),
            callbacks=[logs],
        )  # fmt: skip
        return trainer, logs

    return build


def test_dpo_trainer_is_tiled_and_equals_trls_head(tmp_path):
    """DPO (sigmoid loss) with an explicit reference model: log-probs with gradients, and the
    entropy, mean logits and top-1 flags TRL logs (mean_token_accuracy, logits/chosen). The two
    batches differ in length, so the second step runs the graphs Dynamo recompiles with a symbolic
    token count: tiled too."""
    trl_run, tiled_run = train_both(dpo_builder(), tmp_path, inner="aot_eager", tile_tokens=8)
    trainer = tiled_run[0]
    assert tiled_lm_head_modules(trainer) == [
        "model (LlamaForCausalLM): log_probs, entropy (without gradient), mean_logits, is_top1",
        "ref_model (LlamaForCausalLM): log_probs",
    ]
    rep = assert_tiled(trainer, [1, 1])  # only the log-probs carry a gradient (TRL detaches the entropy)
    assert len(rep.rewrites) == 4 and any(isinstance(r.num_tokens, str) for r in rep.rewrites), str(rep)
    assert any(".argmax()" in r.form for r in rep.rewrites), str(rep)
    assert {"mean_token_accuracy", "logits/chosen", "rewards/margins", "entropy"} <= set(tiled_run[1][0])
    assert_same_run(trl_run, tiled_run)


@pytest.mark.slow
def test_dpo_trainer_bf16_is_tiled_under_autocast(tmp_path):
    """TRL's default bf16=True: accelerate wraps the reference model's forward when the trainer is
    built; the tiled head goes inside that wrapper. Equal to TRL's head within bf16 rounding."""
    trl_run, tiled_run = train_both(dpo_builder(bf16=True), tmp_path, inner="aot_eager", tile_tokens=8)
    trainer = tiled_run[0]
    assert (
        "_original_forward" in trainer.ref_model.__dict__
    )  # accelerate's wrapper, kept around the tiled head
    rep = assert_tiled(trainer, [1])
    assert all("autocast(bfloat16)" in r.form for r in rep.rewrites), str(rep)
    assert_same_run(trl_run, tiled_run, rtol=2e-2, atol=1e-3)


@pytest.mark.slow
def test_dpo_trainer_with_the_default_backend(tmp_path):
    """The line as users write it, ``hand_head_to_tile_pass(trainer)``: Inductor inside (~30 s on 2 cores)."""
    trl_run, tiled_run = train_both(dpo_builder(), tmp_path)
    rep = assert_tiled(tiled_run[0], [1])
    assert all(r.compiled_tiles for r in rep.rewrites), str(rep)
    assert_same_run(trl_run, tiled_run)


# --- RLOO and KTO -----------------------------------------------------------------------------


@pytest.mark.slow
def test_rloo_trainer_is_tiled_and_equals_trls_head(tmp_path):
    path = tmp_path / "tiny"
    tiny_llama().save_pretrained(path)
    prompts = datasets.Dataset.from_list([{"prompt": words(5 + j, 6)} for j in range(4)])

    def build(out):
        logs = Logs()
        args = trl.RLOOConfig(
            **common(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
            beta=0.04, temperature=0.7, gradient_checkpointing=False,
        )  # fmt: skip
        trainer = trl.RLOOTrainer(
            model=str(path), reward_funcs=reward, args=args, train_dataset=prompts,
            processing_class=tiny_tokenizer(), callbacks=[logs],
        )  # fmt: skip
        return trainer, logs

    trl_run, tiled_run = train_both(build, tmp_path, inner="aot_eager", tile_tokens=8)
    assert tiled_lm_head_modules(tiled_run[0]) == [
        "model (LlamaForCausalLM): log_probs, entropy (without gradient)",
        "ref_model (LlamaForCausalLM): log_probs",
    ]
    assert_tiled(tiled_run[0], [1])
    assert_same_run(trl_run, tiled_run)


@pytest.mark.slow
def test_kto_trainer_is_tiled_and_equals_trls_head(tmp_path):
    rows = [
        {"prompt": words(3 + j, 5), "completion": " " + words(40 + j, 4 + j % 2), "label": j % 2 == 0}
        for j in range(8)
    ]
    dataset = datasets.Dataset.from_list(rows)

    def build(out):
        logs = Logs()
        args = trl.KTOConfig(**common(out), per_device_train_batch_size=4, gradient_checkpointing=False)
        trainer = trl.KTOTrainer(
            model=tiny_llama(), ref_model=tiny_llama(), args=args, train_dataset=dataset,
            processing_class=tiny_tokenizer(), callbacks=[logs],
        )  # fmt: skip
        return trainer, logs

    trl_run, tiled_run = train_both(build, tmp_path, inner="aot_eager", tile_tokens=8)
    assert tiled_lm_head_modules(tiled_run[0]) == [
        "model (LlamaForCausalLM): log_probs, entropy (without gradient), mean_logits",
        "ref_model (LlamaForCausalLM): log_probs",
    ]
    assert_tiled(tiled_run[0], [1])
    assert {"kl", "logits/chosen", "rewards/chosen"} <= set(tiled_run[1][0])
    assert_same_run(trl_run, tiled_run)


# --- the entropy's gradient -------------------------------------------------------------------


def test_entropy_gradient_of_trls_head_and_of_the_tiled_head_against_float64():
    """GRPO's entropy bonus differentiates the entropy. TRL 1.16's ChunkedLogProbFunction has an
    entropy term in its backward, so it does not drop that gradient; tile_pass's tiled head
    derives it. Both equal float64 eager (the number is in docs/stacks.md)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    g = torch.Generator().manual_seed(0)
    batch, tokens, hidden_size, temperature = 3, 14, 16, 0.7
    hidden = torch.randn(batch, tokens, hidden_size, generator=g)
    weight = torch.randn(VOCAB, hidden_size, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    labels[:, :5] = -100  # a prompt
    mask = labels != -100

    def bonus(logps, entropy):  # GRPO: the policy term minus coef * the masked mean entropy
        return -(logps * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()

    def entropy_only(logps, entropy):
        return (entropy * mask).sum() / mask.sum()

    def eager64(h, w):
        z = (h @ w.T) / temperature
        lp = z.log_softmax(-1)
        ids = labels.clamp(min=0).unsqueeze(-1)
        return lp.gather(-1, ids).squeeze(-1), -(lp.exp() * lp).sum(-1)

    def trl_head(h, w):
        logps, entropy, *_ = ChunkedLogProbFunction.apply(
            h.reshape(-1, hidden_size), w, None, labels.clamp(min=0).reshape(-1), temperature, 32768,
            None, 1.0, ("log_probs", "entropy"),
        )  # fmt: skip
        return logps.view(batch, tokens), entropy.view(batch, tokens)

    backend = tile_pass.backend("aot_eager", tile_tokens=8)

    @torch.compile(backend=backend)
    def tiled_head(h, w):
        out = per_token_outputs(h, w, labels, outputs=("log_probs", "entropy"), temperature=temperature)
        return out["log_probs"], out["entropy"]

    errors = {}
    for loss_name, loss in (("bonus", bonus), ("entropy", entropy_only)):
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        want = torch.autograd.grad(loss(*eager64(h64, w64)), (h64, w64))
        for name, head in (("trl", trl_head), ("tile_pass", tiled_head)):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            got = torch.autograd.grad(loss(*head(h, w)), (h, w))
            errors[loss_name, name] = max(
                ((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)
            )
    assert backend.report().rewrites and not backend.report().skipped, str(backend.report())
    for key, error in errors.items():
        assert error < 1e-5, (key, errors)
    # dropping the entropy's gradient would be visible: the entropy-only gradient is not small
    h64 = hidden.double().requires_grad_()
    assert torch.autograd.grad(entropy_only(*eager64(h64, weight.double())), h64)[0].norm() > 1e-2


def test_per_token_outputs_match_trls_head_fields():
    """Every field TRL's head computes, eagerly, against TRL's own kernel (temperature, logit scale
    and soft-cap included)."""
    from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS, ChunkedLogProbFunction

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, 16, generator=g)
    weight = torch.randn(VOCAB, 16, generator=g)
    bias = torch.randn(VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (20,), generator=g)
    labels[:4] = -100
    labels[5] = (hidden[5] @ weight.T + bias).argmax()  # one top-1 label at least
    fields = ("log_probs", *OPTIONAL_OUTPUTS)
    mine = per_token_outputs(
        hidden, weight, labels, bias, outputs=fields, temperature=0.8, logit_scale=0.5, softcap=3.0
    )
    theirs = ChunkedLogProbFunction.apply(
        hidden, weight, bias, labels.clamp(min=0), 0.8, 128, 3.0, 0.5, fields
    )  # chunks of 128 vocabulary entries: TRL folds 4 of them
    keep = labels != -100
    for name, x in zip(fields, theirs, strict=True):
        assert torch.equal(mine[name][~keep], torch.zeros_like(mine[name][~keep])), name
        if name == "is_top1":
            assert torch.equal(mine[name][keep], x[keep]) and mine[name][5], name
        else:
            torch.testing.assert_close(mine[name][keep], x[keep], rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="unknown outputs"):
        per_token_outputs(hidden, weight, labels, outputs=("logits",))


# --- reporting and refusals -------------------------------------------------------------------


def test_report_before_and_after_and_a_second_call(tmp_path):
    build = dpo_builder()
    trainer, _ = build(tmp_path)
    hint = next(h for h in report(trainer).hints if "add_fused_lm_head" in h)
    assert "GRPO/RLOO/DPO/KTO" in hint and "hand_head_to_tile_pass" in hint
    hand_head_to_tile_pass(trainer, tile_pass.backend("aot_eager"))
    hints = report(trainer).hints
    assert not any("add_fused_lm_head" in h for h in hints) and any("handed to tile_pass" in h for h in hints)
    with pytest.raises(ValueError, match="no TRL fused LM head"):
        hand_head_to_tile_pass(trainer, "aot_eager")
    # generation (no fused_lm_head) still runs the model's own forward: same tokens as a fresh model
    prompt = torch.tensor([[5, 6, 7, 8]])
    got = trainer.model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, tiny_llama().generate(prompt, max_new_tokens=3, do_sample=False))


def test_a_refused_trainer_keeps_trls_head(tmp_path, monkeypatch):
    """A refusal (here DeepSpeed ZeRO-3) raises with its reason and changes nothing."""
    trainer, _ = dpo_builder()(tmp_path)
    before = {id(m): m.__dict__.get("forward") for m in (trainer.model, trainer.ref_model)}
    monkeypatch.setattr("transformers.integrations.deepspeed.is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="ZeRO-3"):
        hand_head_to_tile_pass(trainer, "aot_eager")
    assert {id(m): m.__dict__.get("forward") for m in (trainer.model, trainer.ref_model)} == before
    assert len(fused_lm_head_modules(trainer)) == 2 and tiled_lm_head_modules(trainer) == []
