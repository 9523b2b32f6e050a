"""Peak memory of one training step per stack, with and without tile_pass, each in a fresh process.

    python examples/stack_memory.py                    # every stack, inductor inside (~11 min on 2 cores)
    python examples/stack_memory.py --stacks trainer peft --inner aot_eager

A randomly initialised 1-layer Llama (vocab 32000, hidden 64, no download) trains on batches
of 2 x 1024 tokens: the float32 logits are 250 MiB, far above everything else. Each
(stack, variant) runs two steps in its own interpreter; the peak is ``VmHWM`` above the
resident size at the start of the second step (compiled, optimizer state allocated), as in
``tile_pass._measure``. Variants: ``compiled`` (the same forward compiled without tile_pass),
``tile_pass`` (``compile_for_training``, returned logits kept exact), ``drop_logits``
(``compile_for_training(..., drop_logits=True)``); TRL adds ``trl_head`` (SFTTrainer's own
fused head) and hands the head back for the others.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types

import torch

import tile_pass
from tile_pass._measure import MiB, peak_memory, reset_peak_memory, run_fresh

VOCAB, HIDDEN, SEQ, BATCH = 32000, 64, 1024, 2
CPU = torch.device("cpu")
STACKS = ("loop", "trainer", "trainer_bf16", "peft", "checkpointing", "lightning", "trl_sft")
VARIANTS = ("compiled", "tile_pass", "drop_logits")


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
    """Reset the peak at the start of the second step, read it at its end."""

    def __init__(self):
        self.base = self.peak = None

    def start(self):
        self.base = reset_peak_memory(CPU)

    def stop(self):
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


def hf_trainer(model, peak, bf16=False, trl_variant=None):
    import datasets
    import transformers

    class PeakCallback(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                peak.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                peak.stop()

    rows = token_rows(2 * BATCH).tolist()
    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=2, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=bf16, logging_steps=1,
    )  # fmt: skip
    if trl_variant is None:
        dataset = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])
        trainer = transformers.Trainer(
            model=model, args=transformers.TrainingArguments(**common), train_dataset=dataset
        )
    else:
        import trl

        from tile_pass.integrations.trl import hand_head_to_tile_pass

        dataset = datasets.Dataset.from_list([{"input_ids": r} for r in rows])
        trainer = trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(**common, max_length=SEQ),
            train_dataset=dataset,
            processing_class=tiny_tokenizer(),
        )
        if trl_variant != "trl_head":
            hand_head_to_tile_pass(trainer)
    trainer.add_callback(PeakCallback())
    result = trainer.train()
    return result.training_loss, trainer


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


def child(stack: str, variant: str, inner: str) -> dict:
    from tile_pass.integrations.transformers import report

    peak = Peak()
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
    if variant != "trl_head":
        prepare(model, variant, inner)
    if stack in ("loop", "peft", "checkpointing"):
        loss = loop_step(model, peak)
    elif stack in ("trainer", "trainer_bf16"):
        loss, _ = hf_trainer(model, peak, bf16=stack == "trainer_bf16")
    elif stack == "lightning":
        loss = lightning_fit(model, peak)
    elif stack == "trl_sft":
        loss, _ = hf_trainer(model, peak, trl_variant=variant)
    else:
        raise ValueError(stack)
    rewritten = len(report(model).rewrites) if variant in ("tile_pass", "drop_logits") else 0
    return {
        "stack": stack, "variant": variant, "peak_mib": peak.peak / MiB, "loss": loss, "rewritten": rewritten,
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
    logits_mib = BATCH * SEQ * VOCAB * 4 / MiB
    print(f"torch {torch.__version__}, tile_pass {tile_pass.__version__}, inner={args.inner}, ", end="")
    print(f"N={BATCH * SEQ} V={VOCAB} H={HIDDEN}: float32 logits {logits_mib:.0f} MiB\n")
    print("| stack | variant | rewritten | peak MiB above the step's start | loss |")
    print("|---|---|---|---|---|")
    for stack in args.stacks:
        variants = (("trl_head",) if stack == "trl_sft" else ()) + VARIANTS
        if stack == "trainer_bf16":
            variants = ("compiled", "tile_pass")  # nothing rewritten today: the same step
        for variant in variants:
            argv = [__file__, "--child", stack, variant, "--inner", args.inner]
            try:
                r = run_fresh(argv, timeout=1200)
            except RuntimeError as error:
                print(f"| {stack} | {variant} | failed: {str(error).splitlines()[-1][:120]} | | |")
                continue
            print(f"| {stack} | {variant} | {r['rewritten']} | {r['peak_mib']:.0f} | {r['loss']:.4f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
