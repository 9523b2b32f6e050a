"""tile_pass inside training stacks: Trainer / accelerate (fp32, bf16), PEFT LoRA, gradient
checkpointing, Lightning, generate(), TRL (SFT and a GRPO-style step). Tiny random configs,
no downloads, a few steps each; aot_eager inside (Lightning's literal ``backend="tile_pass"``,
inductor inside, runs with ``-m slow``)."""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
import torch.nn.functional as F

import tile_pass

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
transformers.logging.set_verbosity_error()

from tile_pass.integrations.transformers import (  # noqa: E402  (needs transformers)
    TilePassCallback,
    backend_of,
    compile_for_training,
    report,
)

VOCAB, SEQ = 512, 24


def tiny_llama(seed=0, **config):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1, **config,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def token_rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n, SEQ), generator=g)


def lm_dataset(n=16, with_labels=True):
    datasets = pytest.importorskip("datasets")
    rows = token_rows(n).tolist()
    return datasets.Dataset.from_list(
        [{"input_ids": r, **({"labels": r} if with_labels else {})} for r in rows]
    )


class LossLog(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def training_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, bf16=False,
    )  # fmt: skip
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def train(model, tmp_path, callbacks=(), **overrides):
    log = LossLog()
    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path, **overrides),
        train_dataset=lm_dataset(),
        callbacks=[log, *callbacks],
    )
    trainer.train()
    return trainer, log.losses


def compiled_plain(model, inner="aot_eager"):
    """The same forward compiled without tile_pass (the reference for bf16)."""
    model.forward = types.MethodType(torch.compile(type(model).forward, backend=inner), model)
    return model


# --- transformers.Trainer / accelerate ---------------------------------------------------


def test_trainer_fp32_is_rewritten_and_matches_the_untiled_run(tmp_path):
    model = compile_for_training(tiny_llama(), "aot_eager", tile_tokens=16)
    assert backend_of(model) is not None
    trainer, losses = train(model, tmp_path / "tiled")  # remove_unused_columns=True (the default)
    _, reference = train(tiny_llama(), tmp_path / "eager")

    rep = report(trainer)
    assert len(rep.rewrites) >= 1 and not rep.skipped, str(rep)
    rewrite = rep.rewrites[0]
    assert rewrite.reduction.startswith("sum:")  # gradient accumulation: num_items_in_batch reaches the loss
    assert rewrite.num_tokens == 2 * SEQ and rewrite.num_tiles == 3
    assert len(losses) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    # the model keeps its class, parameter names and a deep copy runs its own weights
    assert type(trainer.model) is transformers.LlamaForCausalLM
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin


def test_trainer_bf16_is_rewritten_under_accelerates_autocast(tmp_path, caplog):
    """accelerate's autocast wraps the compiled forward; the head under autocast returns its
    logits and is tiled, with losses within bf16 rounding of the untiled run."""
    callback = TilePassCallback("aot_eager", tile_tokens=16)  # compiles at construction
    with caplog.at_level(logging.INFO, logger="tile_pass"):
        trainer, losses = train(tiny_llama(), tmp_path / "tiled", [callback], bf16=True)
    _, reference = train(compiled_plain(tiny_llama()), tmp_path / "plain", bf16=True)

    rep = callback.report
    assert rep is not None and rep.rewrites and not rep.skipped, str(rep)
    assert "autocast(bfloat16)" in rep.rewrites[0].form
    assert len(losses) == len(reference)
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 2e-2 * abs(want), (losses, reference)
    assert str(report(trainer)) == str(rep)


def test_trainer_bf16_with_model_compile_tiles_accelerates_upcast(tmp_path):
    """The user's setup: model.compile() puts accelerate's _convert_to_fp32 (a .float() of the
    returned logits) in the graph; that upcast is a row-wise output of the region."""
    backend = tile_pass.backend("aot_eager", tile_tokens=16)
    model = tiny_llama()
    model.compile(backend=backend)
    trainer, _ = train(model, tmp_path, bf16=True, max_steps=1)
    rep = report(trainer, backend)
    assert len(rep.rewrites) == 1 and not rep.skipped, str(rep)
    assert "rows" in rep.rewrites[0].form and "autocast(bfloat16)" in rep.rewrites[0].form, str(rep)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- PEFT -----------------------------------------------------------------------------------


def test_peft_lora_is_rewritten_with_a_frozen_head(monkeypatch):
    peft = pytest.importorskip("peft")
    # peft 0.21 refuses any installed torchao older than 0.16 when it dispatches a LoRA layer, and
    # torchtune 0.6.1 (tests/test_torchtune.py) needs torchao 0.15; no layer here is quantized
    import peft.tuners.lora.torchao as lora_torchao

    monkeypatch.setattr(lora_torchao, "is_torchao_available", lambda: False)

    def lora(seed):
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights=False,  # non-zero B: every adapter gets a gradient
        )  # fmt: skip
        return peft.get_peft_model(tiny_llama(), config)

    ids = token_rows(2)
    tiled = compile_for_training(lora(1), "aot_eager", tile_tokens=16)
    eager = lora(1)
    for model in (tiled, eager):
        model(input_ids=ids, labels=ids).loss.backward()

    rep = report(tiled)
    assert len(rep.rewrites) == 1 and not rep.skipped, str(rep)
    head = tiled.get_base_model().lm_head.weight
    assert not head.requires_grad and head.grad is None
    grads = {n: p.grad for n, p in tiled.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(expected) and len(grads) == 4 and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


# --- gradient checkpointing -----------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing(reentrant):
    ids = token_rows(2)
    models = []
    for compiled in (True, False):
        model = tiny_llama().train()
        checkpointing = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        if compiled:
            compile_for_training(model, "aot_eager", tile_tokens=16)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        models.append(model)
    tiled, eager = models

    rep = report(tiled)
    assert len(rep.rewrites) == 1 and not rep.skipped, str(rep)
    for (name, p), q in zip(tiled.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


# --- Lightning --------------------------------------------------------------------------------


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning")
    return pl


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        # the user's literal line: inductor and compiled tiles inside (~35 s cold on 2 cores)
        pytest.param("tile_pass", marks=pytest.mark.slow),
    ],
)
def test_lightning_module_with_model_compile(backend):
    pl = _lightning()
    compiler = tile_pass.default_backend() if backend == "tile_pass" else tile_pass.backend(backend)
    seen = len(compiler.reports)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.model.compile(backend="tile_pass" if backend == "tile_pass" else compiler)
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LM()
    batch = token_rows(2)
    with torch.no_grad():
        expected = tiny_llama()(input_ids=batch, labels=batch).loss
    trainer = pl.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batch, batch_size=2))

    new = list(compiler.reports)[seen:]
    assert sum(len(g.rewrites) for g in new) == 1, [str(g.rewrites) for g in new]
    torch.testing.assert_close(module.losses[0], expected, rtol=1e-5, atol=1e-6)


# --- generate() -----------------------------------------------------------------------------


def test_generate_on_a_compiled_model():
    model = tiny_llama().eval()
    prompt = token_rows(2)[:, :6]
    expected = model.generate(prompt, max_new_tokens=3, do_sample=False)
    compile_for_training(model, "aot_eager")
    got = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, expected)
    rep = report(model)
    assert rep.graphs and not rep.rewrites  # no labels: nothing to tile
    # each graph's head is accounted for: its logits leave the graph whole, and the report says so
    assert all("leaves graph" in skip.reason for skip in rep.skipped), str(rep)
    assert any("generation" in hint for hint in rep.hints), rep.hints


# --- TRL --------------------------------------------------------------------------------------


def import_trl():
    trl = pytest.importorskip("trl")
    if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head (add_fused_lm_head arrived in the 1.x series)")
    return trl


def tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<pad>"] = 0
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="t1")


def sft_trainer(trl, model, tmp_path):
    log = LossLog()
    args = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True,
        bf16=False,  # TRL's default is bf16=True: see test_trainer_bf16_*
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=lm_dataset(8, with_labels=False),
        processing_class=tiny_tokenizer(),
        callbacks=[log],
    )
    return trainer, log


def test_trl_sft_head_is_named_and_handed_back(tmp_path):
    trl = import_trl()
    from tile_pass.integrations.trl import fused_lm_head_modules, hand_head_to_tile_pass

    # TRL's own head: the compiled forward is never called with labels, tile_pass sees no head
    trl_head, trl_log = sft_trainer(trl, compile_for_training(tiny_llama(), "aot_eager"), tmp_path / "a")
    assert fused_lm_head_modules(trl_head) == ["model (LlamaForCausalLM)"]
    trl_head.train()
    rep = report(trl_head)
    assert not rep.rewrites and not rep.skipped
    assert any("add_fused_lm_head" in hint and "hand_head_to_tile_pass" in hint for hint in rep.hints)
    assert "add_fused_lm_head" in str(rep)

    # handed back: the model's own loss, tiled
    model = compile_for_training(tiny_llama(), "aot_eager", tile_tokens=16)
    trainer, log = sft_trainer(trl, model, tmp_path / "b")
    hand_head_to_tile_pass(trainer)
    assert fused_lm_head_modules(trainer) == [] and backend_of(trainer) is not None
    trainer.train()
    rep = report(trainer)
    assert len(rep.rewrites) >= 1 and not rep.skipped, str(rep)
    assert rep.rewrites[0].reduction.startswith("sum:")  # num_items_in_batch, as TRL's loss divides
    assert len(log.losses) == 2
    torch.testing.assert_close(torch.tensor(log.losses), torch.tensor(trl_log.losses), rtol=1e-5, atol=1e-6)


def test_trl_grpo_trainer_head_is_named(tmp_path):
    trl = import_trl()
    datasets = pytest.importorskip("datasets")
    from tile_pass.integrations.trl import fused_lm_head_modules, hand_head_to_tile_pass

    prompts = datasets.Dataset.from_list([{"prompt": " ".join(f"t{i}" for i in range(5, 12))}] * 4)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, max_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no",
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=compile_for_training(tiny_llama(), "aot_eager"),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=prompts,
        processing_class=tiny_tokenizer(),
    )
    assert fused_lm_head_modules(trainer) == ["model (LlamaForCausalLM)"]
    hand_head_to_tile_pass(trainer)  # real steps, against TRL's head: tests/test_trl_trainers.py
    assert fused_lm_head_modules(trainer) == []
    assert trainer.model.forward._tile_pass_backend is backend_of(trainer)  # compile_for_training's


def test_empty_report_names_trl_when_it_is_imported():
    pytest.importorskip("trl")
    text = str(tile_pass.Report())
    assert "no linear + cross_entropy candidate" in text
    assert "add_fused_lm_head" in text and "selective_log_softmax" in text


def per_token_logps(logits, labels):
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    return -flat.view_as(labels)


def grpo_step(model, logps_of, entropy_coef=0.0):
    """A GRPO-style loss: clipped ratio of per-token log-probs times the advantages."""

    def step(ids, mask, old_logps, advantages):
        logits = model(input_ids=ids).logits[:, :-1]
        logps = logps_of(logits, ids[:, 1:])
        ratio = torch.exp(logps - old_logps)
        per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        if entropy_coef:
            probs = logits.float().softmax(-1)
            per_token = per_token + entropy_coef * (probs * probs.clamp_min(1e-12).log()).sum(-1)
        return (per_token * mask).sum() / mask.sum()

    return step


@pytest.mark.parametrize("variant", ["log_probs", "with_entropy", "trl_selective_log_softmax"])
def test_grpo_style_per_token_log_probs(variant):
    model = tiny_llama()
    ids = token_rows(2)
    mask = torch.ones(2, SEQ - 1)
    mask[0, :10] = 0  # the prompt
    advantages = torch.tensor([[0.5], [-1.0]])
    logps_of = per_token_logps
    if variant == "trl_selective_log_softmax":
        pytest.importorskip("trl")
        from trl.trainer.utils import selective_log_softmax as logps_of  # noqa: N813
    with torch.no_grad():
        old = per_token_logps(model(input_ids=ids).logits[:, :-1], ids[:, 1:]) - 0.05
    step = grpo_step(model, logps_of, entropy_coef=0.01 if variant == "with_entropy" else 0.0)

    backend = tile_pass.backend("aot_eager", tile_tokens=16)
    loss = torch.compile(step, backend=backend)(ids, mask, old, advantages)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = step(ids, mask, old, advantages)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)

    rep = backend.report()
    if variant == "log_probs":  # the logits feed only the cross entropy: tiled, reduction="none"
        assert len(rep.rewrites) == 1 and rep.rewrites[0].reduction == "none", str(rep)
    elif variant == "with_entropy":  # the entropy reads the logits a second time: one region, both outputs
        assert len(rep.rewrites) == 1 and not rep.skipped, str(rep)
        assert "softmax" in rep.rewrites[0].form and ".clamp_min(1e-12)" in rep.rewrites[0].form, str(rep)
    else:  # TRL's logsumexp loop + gather after the token slice: one row-wise region
        assert len(rep.rewrites) == 1 and not rep.skipped, str(rep)
        assert "slice tokens" in rep.rewrites[0].form and ".logsumexp()" in rep.rewrites[0].form, str(rep)


def test_every_integration_takes_its_options_one_way():
    """``inner`` (a name, a backend callable or a ready Backend) and ``tile_pass.backend``'s
    keywords, resolved by one helper: an unknown keyword, or options beside a ready Backend, raise."""
    import inspect

    from tile_pass.integrations import deepspeed, torchtune, trl
    from tile_pass.integrations._head import backend_from

    backend = backend_from(None, {"tile_tokens": 8}, default="aot_eager")
    assert backend.inner == "aot_eager" and backend.tiling.tile_tokens == 8
    assert backend_from(backend, {}) is backend
    with pytest.raises(ValueError, match="not both"):
        backend_from(backend, {"tile_tokens": 8})
    with pytest.raises(TypeError, match="tile_tokenz"):
        backend_from("aot_eager", {"tile_tokenz": 8})
    entries = [compile_for_training, trl.hand_head_to_tile_pass, torchtune.hand_head_to_tile_pass,
               torchtune.TiledCrossEntropyLoss, deepspeed.compile_engine]  # fmt: skip
    for entry in entries:
        parameters = inspect.signature(entry).parameters
        assert "inner" in parameters and parameters["backend_options"].kind is inspect.Parameter.VAR_KEYWORD
