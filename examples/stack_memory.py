"""Peak memory of one training step per stack, with and without tile_pass, each in a fresh process.

    python examples/stack_memory.py                    # every stack, inductor inside
    python examples/stack_memory.py --stacks trainer peft --inner aot_eager
    python examples/stack_memory.py --stacks torchtune torchtitan   # the pretraining stacks
    python examples/stack_memory.py --stacks trl_sft trl_grpo trl_dpo   # TRL's trainers

A randomly initialised 1-layer Llama (vocab 32000, hidden 64, no download) trains on batches
of 2 x 1024 tokens: the float32 logits are 250 MiB, far above everything else. Each
(stack, variant) runs two steps in its own interpreter; the peak is ``VmHWM`` above the
resident size at the start of the second step (compiled, optimizer state allocated), as in
``tile_pass._measure``. Variants: ``compiled`` (the same forward compiled without tile_pass),
``tile_pass`` (``compile_for_training``, returned logits kept exact), ``drop_logits``
(``compile_for_training(..., drop_logits=True)``).

TRL's trainers (``trl_sft``, ``trl_grpo``, ``trl_dpo``, see :func:`trl_train`) run at 8192 tokens
a step, where TRL's own head chunks, as shipped (``trl_head``) and with
``hand_head_to_tile_pass(trainer)`` (``tile_pass``); the time is their measured step's own.

``torchtune`` and ``torchtitan`` run at N = 8 x 1024 = 8192 tokens (float32 logits 1000 MiB),
where their shipped chunked losses split the logits 8 ways: a first step (compiles), the second
for peak memory, then three for time (the median, under the allocator's steady state, as
``tile_pass._measure.measure_steps``; the other stacks' time is their measured step's own).
torchtune: its own builder (``llama3``, 1 layer, dim 64) and the recipe's own ``_loss_step``
(``full_finetune_single_device``), with ``ce`` (``torch.nn.CrossEntropyLoss``, whole logits),
``chunked`` (``CEWithChunkedOutputLoss``, as torchtune's configs ship it), ``chunked_compiled``
(the same with the recipe's ``compile: True``: each layer and the chunk's cross entropy
compiled) and ``tile_pass`` (``hand_head_to_tile_pass(recipe)``). torchtitan:
``llama3_debugmodel`` (1 layer, dim 256, vocab 32000, SDPA) through the trainer's own
``post_dataloading_process`` and ``_forward_backward_body`` on one gloo rank, with ``ce``
(``CrossEntropyLoss``), ``chunked`` (``ChunkedLossWrapper``, the shipped default),
``chunked_compiled`` (``compile.enable`` for the model and the loss) and ``tile_pass``
(``--override.imports tile_pass.integrations.torchtitan.tiled_loss``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import types

import torch

import tile_pass
from tile_pass._measure import MiB, measure_steps, peak_memory, reset_peak_memory, run_fresh

VOCAB, HIDDEN, SEQ, BATCH = 32000, 64, 1024, 2
CPU = torch.device("cpu")
STACKS = ("loop", "trainer", "trainer_bf16", "peft", "checkpointing", "lightning", "trl_sft", "trl_grpo",
          "trl_dpo", "torchtune", "torchtitan")  # fmt: skip
VARIANTS = ("compiled", "tile_pass", "drop_logits")
PRETRAINING_STACKS = ("torchtune", "torchtitan")
PRETRAINING_VARIANTS = ("ce", "chunked", "chunked_compiled", "tile_pass")
PRETRAINING_BATCH = 8  # x SEQ = 8192 tokens: both shipped chunked losses split them 8 ways
#: TRL's stacks, run at PRETRAINING_BATCH x SEQ tokens, where TRL's head (4096 tokens a chunk) chunks
TRL_STACKS = ("trl_sft", "trl_grpo", "trl_dpo")


def tiny_llama():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def token_rows(n):
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, VOCAB, (n, SEQ), generator=g)


def prepare(model, variant, inner) -> None:
    """Compile ``model``'s forward in place: without tile_pass, or with it."""
    from tile_pass.integrations.transformers import compile_for_training

    if variant == "compiled":
        model.forward = types.MethodType(torch.compile(type(model).forward, backend=inner), model)
    else:
        compile_for_training(model, inner, drop_logits=variant == "drop_logits")


class Peak:
    """Reset the peak at the start of the measured step, read it (and the step's time) at its end."""

    def __init__(self):
        self.base = self.peak = self.seconds = None

    def start(self):
        self.base = reset_peak_memory(CPU)
        self.t0 = time.perf_counter()

    def stop(self):
        self.seconds = time.perf_counter() - self.t0
        self.peak = peak_memory(CPU) - self.base


def loop_step(model, peak, steps=2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = token_rows(BATCH)
    for i in range(steps):
        if i == steps - 1:
            peak.start()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == steps - 1:
            peak.stop()
    return float(loss)


def peak_callback(peak: Peak):
    """A ``transformers.TrainerCallback`` that measures the second optimizer step."""
    import transformers

    class PeakCallback(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                peak.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                peak.stop()

    return PeakCallback()


def _trainer_args(batch, bf16=False) -> dict:
    return dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=2, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=bf16, logging_steps=1,
    )  # fmt: skip


def hf_trainer(model, peak, bf16=False):
    import datasets
    import transformers

    rows = token_rows(2 * BATCH).tolist()
    dataset = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])
    args = transformers.TrainingArguments(**_trainer_args(BATCH, bf16))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(peak_callback(peak))
    return trainer.train().training_loss


def _words(row) -> str:
    return " ".join(f"t{i}" for i in row)


def trl_train(stack, variant, inner, peak):
    """TRL's own trainer on the tiny Llama at ``PRETRAINING_BATCH x SEQ`` tokens a step, as TRL
    ships it (``trl_head``: its fused head, 4096 tokens a chunk) or with
    ``hand_head_to_tile_pass(trainer)``. SFT: 8 rows of 1024 tokens. GRPO: 8 completions
    of 1024 sampled tokens (8 generations of one prompt per step, a reference model, beta 0.04;
    generation is part of the step's time). DPO: 4 preference pairs whose prompt + chosen and
    prompt + rejected are 1024 tokens each, a reference model."""
    import datasets
    import trl

    from tile_pass.integrations.trl import hand_head_to_tile_pass

    model = tiny_llama().train()
    rows = token_rows(2 * PRETRAINING_BATCH).tolist()
    common = _trainer_args(PRETRAINING_BATCH)
    if stack == "trl_sft":
        dataset = datasets.Dataset.from_list([{"input_ids": r} for r in rows])
        args = trl.SFTConfig(**common, max_length=SEQ)
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer()
        )
    elif stack == "trl_grpo":
        path = tempfile.mkdtemp()
        model.save_pretrained(path)  # GRPO builds its reference model from the policy's path
        dataset = datasets.Dataset.from_list([{"prompt": _words(r[:8])} for r in rows])
        args = trl.GRPOConfig(
            **common, num_generations=PRETRAINING_BATCH, max_completion_length=SEQ, beta=0.04,
            generation_kwargs={"min_new_tokens": SEQ},  # every completion is SEQ tokens long
        )  # fmt: skip

        def reward(completions, **kwargs):
            return [float(len(c) % 7) for c in completions]

        trainer = trl.GRPOTrainer(
            model=path, reward_funcs=reward, args=args, train_dataset=dataset,
            processing_class=tiny_tokenizer(),
        )  # fmt: skip
    elif stack == "trl_dpo":
        pairs = [
            {"prompt": _words(r[:8]), "chosen": " " + _words(r[8:]), "rejected": " " + _words(r[:7:-1])}
            for r in rows
        ]
        args = trl.DPOConfig(
            **{**common, "per_device_train_batch_size": PRETRAINING_BATCH // 2}, max_length=SEQ
        )
        trainer = trl.DPOTrainer(
            model=model, ref_model=tiny_llama(), args=args, train_dataset=datasets.Dataset.from_list(pairs),
            processing_class=tiny_tokenizer(),
        )  # fmt: skip
    else:
        raise ValueError(stack)
    if variant == "tile_pass":
        hand_head_to_tile_pass(trainer, inner)
    trainer.add_callback(peak_callback(peak))
    return trainer.train().training_loss, trainer


def tiny_tokenizer():
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<pad>"] = 0
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="t1")


def lightning_fit(model, peak):
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:
                peak.start()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 1:
                peak.stop()
                self.last_loss = float(outputs["loss"])

    module = LM()
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(token_rows(2 * BATCH), batch_size=BATCH))
    return module.last_loss


def _measure_pretraining_steps(step, repeats=3) -> dict:
    """A first step (compiles), the second for peak memory, then ``repeats`` for time under
    the allocator's steady state (``tile_pass._measure.measure_steps``); the median time."""
    step()
    measured = measure_steps(step, CPU, repeats)
    return {
        "peak_mib": measured.peak_above / MiB, "loss": float(measured.loss),
        "step_s": measured.times[len(measured.times) // 2],
    }  # fmt: skip


def _load_torchtune_recipe(name: str):
    """A recipe that torchtune installs as ``recipes/<name>.py``, loaded by its path."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("recipes")
    path = os.path.join(list(spec.submodule_search_locations)[0], f"{name}.py")
    module_spec = importlib.util.spec_from_file_location(f"torchtune_recipe_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def torchtune_train(variant, inner):
    """torchtune's model builder and loss, set up as ``full_finetune_single_device.setup``
    sets them up, and the recipe's own ``_loss_step``, then its token scaling and AdamW."""
    from torchtune import training
    from torchtune.models.llama3 import llama3
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    from tile_pass.integrations.torchtune import hand_head_to_tile_pass, report

    recipe_class = _load_torchtune_recipe("full_finetune_single_device").FullFinetuneRecipeSingleDevice
    torch.manual_seed(0)
    model = llama3(vocab_size=VOCAB, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=HIDDEN,
                   max_seq_len=SEQ, intermediate_dim=2 * HIDDEN)  # fmt: skip
    loss_fn = torch.nn.CrossEntropyLoss() if variant == "ce" else CEWithChunkedOutputLoss()
    if variant == "chunked_compiled":  # the recipe's compile: True
        os.environ["TORCH_COMPILE_BACKEND"] = inner  # torchtune's compile helpers read it
        training.compile_model(model)
        training.compile_loss(loss_fn)
    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    recipe = types.SimpleNamespace(
        _model=model, _loss_fn=loss_fn, activations_handling_ctx=contextlib.nullcontext(),
        ignore_labels_cache=torch.full((PRETRAINING_BATCH, 1), -100, dtype=torch.long),
    )  # fmt: skip
    if variant == "tile_pass":
        hand_head_to_tile_pass(recipe, inner)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = token_rows(PRETRAINING_BATCH)

    def step():
        batch = {"tokens": tokens, "labels": tokens.clone()}
        num_tokens = (batch["labels"][..., 1:] != -100).sum()  # the recipe's count (shifted labels)
        loss = recipe_class._loss_step(recipe, batch) * num_tokens
        loss.backward()
        training.scale_grads(model, 1 / num_tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach() / num_tokens

    measured = _measure_pretraining_steps(step)
    measured["rewritten"] = len(report(recipe).rewrites) if variant == "tile_pass" else 0
    return measured


def torchtitan_train(variant, inner):
    """torchtitan's ``llama3_debugmodel`` config (1 layer, vocab 32000, SDPA, float32), the
    model and loss built as ``Trainer.__init__`` builds them, on one gloo rank; each step the
    trainer's own ``post_dataloading_process`` and ``_forward_backward_body``, then AdamW."""
    from tile_pass.integrations import torchtitan as titan  # before torchtitan's models (triton)

    # isort: split
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = llama3_debugmodel()
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:1]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.vocab_size = model_config.tok_embeddings.num_embeddings = VOCAB
    model_config.lm_head.out_features = VOCAB
    config.loss.loss_fn.global_vocab_size = VOCAB
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"
    config.compile.backend = inner
    if variant == "ce":
        config.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    if variant == "chunked_compiled":
        config.compile.enable = True
        config.compile.components = ["model", "loss"]
    if variant == "tile_pass":  # what the trainer does with --override.imports
        config.override = OverrideConfig(imports=["tile_pass.integrations.torchtitan.tiled_loss"])
        apply_overrides(config.override, config)

    parallel_dims_module.device_type = "cpu"  # torchtitan's mesh follows its detected accelerator
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    parallel_dims = ParallelDims.from_config(config.parallelism, 1)
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=None, dump_folder="",
    )  # fmt: skip
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    trainer = types.SimpleNamespace(
        model_parts=[model], loss_fn=loss_fn, config=config, model_config=model_config,
        parallel_dims=parallel_dims, ntokens_seen=0,
        train_context=dist_utils.get_spmd_context(parallel_dims=parallel_dims),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = token_rows(PRETRAINING_BATCH)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)  # the next token
    gvt = (labels != -100).sum()

    def step():
        inputs, step_labels, extra = Trainer.post_dataloading_process(trainer, {"input": tokens}, labels)
        loss = Trainer._forward_backward_body(trainer, inputs, step_labels, gvt, extra)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    measured = _measure_pretraining_steps(step)
    measured["rewritten"] = len(titan.report(loss_fn).rewrites) if variant == "tile_pass" else 0
    dist.destroy_process_group()
    return measured


def child(stack: str, variant: str, inner: str) -> dict:
    from tile_pass.integrations.transformers import report

    peak = Peak()
    if stack in PRETRAINING_STACKS:
        train = torchtune_train if stack == "torchtune" else torchtitan_train
        return {
            "stack": stack,
            "variant": variant,
            "tokens": PRETRAINING_BATCH * SEQ,
            **train(variant, inner),
        }
    if stack in TRL_STACKS:
        from tile_pass.integrations.transformers import report

        loss, trainer = trl_train(stack, variant, inner, peak)
        return {
            "stack": stack, "variant": variant, "peak_mib": peak.peak / MiB, "loss": loss,
            "rewritten": len(report(trainer).rewrites) if variant == "tile_pass" else 0,
            "step_s": peak.seconds, "tokens": PRETRAINING_BATCH * SEQ,
        }  # fmt: skip
    model = tiny_llama().train()
    if stack == "peft":
        import peft

        config = peft.LoraConfig(task_type="CAUSAL_LM", r=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, config)
    if stack == "checkpointing":
        model.config.use_cache = False
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    prepare(model, variant, inner)
    if stack in ("loop", "peft", "checkpointing"):
        loss = loop_step(model, peak)
    elif stack in ("trainer", "trainer_bf16"):
        loss = hf_trainer(model, peak, bf16=stack == "trainer_bf16")
    elif stack == "lightning":
        loss = lightning_fit(model, peak)
    else:
        raise ValueError(stack)
    rewritten = len(report(model).rewrites) if variant in ("tile_pass", "drop_logits") else 0
    return {
        "stack": stack, "variant": variant, "peak_mib": peak.peak / MiB, "loss": loss, "rewritten": rewritten,
        "step_s": peak.seconds, "tokens": BATCH * SEQ,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stacks", nargs="*", default=list(STACKS), choices=STACKS)
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--child", nargs=2, metavar=("STACK", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.inner)))
        return
    print(f"torch {torch.__version__}, tile_pass {tile_pass.__version__}, inner={args.inner}, ", end="")
    print(f"V={VOCAB}; ", end="")
    print(f"float32 logits: {BATCH * SEQ * VOCAB * 4 / MiB:.0f} MiB at N={BATCH * SEQ}, ", end="")
    print(f"{PRETRAINING_BATCH * SEQ * VOCAB * 4 / MiB:.0f} MiB at N={PRETRAINING_BATCH * SEQ}\n")
    print("| stack | variant | N | rewritten | peak MiB above the step's start | step s | loss |")
    print("|---|---|---|---|---|---|---|")
    for stack in args.stacks:
        variants = ("trl_head", "tile_pass") if stack in TRL_STACKS else VARIANTS
        if stack == "trainer_bf16":
            variants = ("compiled", "tile_pass")  # nothing rewritten today: the same step
        if stack in PRETRAINING_STACKS:
            variants = PRETRAINING_VARIANTS
        for variant in variants:
            argv = [__file__, "--child", stack, variant, "--inner", args.inner]
            start = time.perf_counter()  # progress on stderr: stdout is the table
            print(f"running {stack} / {variant} in a fresh process ...", file=sys.stderr, flush=True)
            try:
                r = run_fresh(argv, timeout=1200)
            except RuntimeError as error:
                print(f"| {stack} | {variant} | | failed: {str(error).splitlines()[-1][:120]} | | | |")
                continue
            print(f"    done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            print(f"| {stack} | {variant} | {r['tokens']} | {r['rewritten']} | {r['peak_mib']:.0f} | "
                  f"{r['step_s']:.2f} | {r['loss']:.4f} |")  # fmt: skip
            sys.stdout.flush()


if __name__ == "__main__":
    main()
