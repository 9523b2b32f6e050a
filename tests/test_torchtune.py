"""torchtune's own recipe (``full_finetune_single_device``) trained on a tiny Llama 3 built by
torchtune's model builder, its shipped chunked loss against the same recipe with
``hand_head_to_tile_pass(recipe)``: rewritten per the backend's report, and the losses and the
output projection's gradients equal (float32, CPU, ``inner="aot_eager"``)."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

torchtune = pytest.importorskip("torchtune", reason="torchtune is not installed")
from omegaconf import OmegaConf  # noqa: E402  (torchtune depends on it)

from tile_pass.integrations import torchtune as tt  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 512, 24, 2, 2


def _load_recipe(name: str):
    """A recipe file that torchtune installs as ``recipes/<name>.py`` (a directory its
    ``__init__`` forbids importing from; ``tune run`` runs the file), loaded by its path."""
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune's recipes are not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], f"{name}.py")
    module_spec = importlib.util.spec_from_file_location(f"torchtune_recipe_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


recipes = _load_recipe("full_finetune_single_device")


def tiny_llama3():
    """torchtune's own builder, one layer, a 512-token vocabulary."""
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=VOCAB, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32,
                  max_seq_len=64, intermediate_dim=64)  # fmt: skip


def tiny_tokenizer(*args, **kwargs):
    """All the recipe asks of a tokenizer here: its padding id."""
    return types.SimpleNamespace(pad_id=0)


def token_dataset(tokenizer, n: int = BATCH * STEPS):
    """Rows as torchtune's SFT datasets give them, a prompt masked out of the labels."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        tokens = torch.randint(1, VOCAB, (SEQ - i % 2,), generator=g).tolist()  # padded by the collator
        labels = [-100] * 5 + tokens[5:]
        rows.append({"tokens": tokens, "labels": labels})
    return rows


def _config(tmp_path, loss: str, compile_: bool = False):
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    torch.save(tiny_llama3().state_dict(), ckpt / "model.pt")
    return OmegaConf.create({
        "output_dir": str(tmp_path / "out"),
        "model": {"_component_": "test_torchtune.tiny_llama3"},
        "tokenizer": {"_component_": "test_torchtune.tiny_tokenizer"},
        "dataset": {"_component_": "test_torchtune.token_dataset"},
        "checkpointer": {
            "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
            "checkpoint_dir": str(ckpt), "checkpoint_files": ["model.pt"],
            "output_dir": str(tmp_path / "out"), "model_type": "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "seed": 0, "shuffle": False, "batch_size": BATCH, "epochs": 1, "max_steps_per_epoch": STEPS,
        "gradient_accumulation_steps": 1, "optimizer_in_bwd": False,
        "optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1},
        "loss": {"_component_": loss},
        "compile": compile_, "device": "cpu", "dtype": "fp32",
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": str(tmp_path / "logs")},
        "log_every_n_steps": 1, "log_peak_memory_stats": False,
    })  # fmt: skip


def _train(tmp_path, loss: str, tiled: bool, compile_: bool = False):
    """The recipe's own setup and train loop; the loss each step and the output projection's
    gradient each step (as the optimizer sees it, after the recipe's token scaling)."""
    cfg = _config(tmp_path, loss, compile_)
    recipe = recipes.FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    if tiled:
        tt.hand_head_to_tile_pass(recipe, inner="aot_eager", tile_tokens=16)
    losses, grads = [], []
    weight = recipe._model.output.weight
    weight.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.detach().clone()))
    step = recipe._loss_step

    def loss_step(batch):
        loss = step(batch)
        losses.append(loss.detach().clone())
        return loss

    recipe._loss_step = loss_step
    recipe.train()
    recipe.cleanup()
    return recipe, losses, grads, weight.detach().clone()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The recipe as shipped, uncompiled, with torchtune's CEWithChunkedOutputLoss."""
    return _train(tmp_path_factory.mktemp("shipped"), "torchtune.modules.loss.CEWithChunkedOutputLoss", False)


def _assert_equal_runs(reference, result):
    _, ref_losses, ref_grads, ref_weight = reference
    _, losses, grads, weight = result
    assert len(losses) == len(ref_losses) == STEPS and len(grads) == len(ref_grads) == STEPS
    for step in range(STEPS):
        torch.testing.assert_close(losses[step], ref_losses[step], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[step], ref_grads[step], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-6, atol=1e-7)


def test_recipe_with_the_chunked_loss_is_rewritten_and_exact(tmp_path, shipped):
    result = _train(tmp_path, "torchtune.modules.loss.CEWithChunkedOutputLoss", True)
    recipe = result[0]
    assert isinstance(recipe._loss_fn, tt.TiledCrossEntropyLoss)
    assert recipe._model.num_output_chunks == 0
    report = tt.report(recipe)
    assert len(report.rewrites) == 1, str(report)
    form = report.rewrites[0].form  # the cross-entropy chain's, or the row-wise region's
    assert "cross_entropy" in form and "ignore_index=-100" in form, form
    _assert_equal_runs(shipped, result)
    # the model hands hidden states to the loss; restore_output_layer gives logits back
    tokens = torch.randint(0, VOCAB, (1, 8))
    assert recipe._model(tokens).shape[-1] == 32
    tt.restore_output_layer(recipe._model)
    assert recipe._model(tokens).shape[-1] == VOCAB


def test_recipe_with_plain_cross_entropy_and_compile_true(tmp_path, shipped, monkeypatch):
    """``loss: torch.nn.CrossEntropyLoss`` and ``compile: True`` (torchtune compiles each layer
    with $TORCH_COMPILE_BACKEND, which the tiled loss also takes as its inner compiler)."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    result = _train(tmp_path, "torch.nn.CrossEntropyLoss", True, compile_=True)
    report = tt.report(result[0])
    assert len(report.rewrites) == 1, str(report)
    _assert_equal_runs(shipped, result)


def test_the_shipped_compile_leaves_nothing_to_tile():
    """Why the hand-over is needed: torchtune's compile_loss compiles only the chunk's
    cross entropy, whose graph receives the logits; tile_pass skips it and says why."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    import tile_pass

    torch.manual_seed(0)
    model = tiny_llama3()
    loss_fn = CEWithChunkedOutputLoss()
    backend = tile_pass.backend("aot_eager")
    loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy, backend=backend)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    tokens = torch.randint(0, VOCAB, (2, 16))
    loss_fn(model(tokens), tokens).backward()
    report = backend.report()
    assert not report.rewrites
    assert report.skipped and all("logits are an input" in s.reason for s in report.skipped), str(report)


def test_a_loss_it_cannot_stand_in_for_is_refused():
    recipe = types.SimpleNamespace(
        _model=tiny_llama3(), _loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    )
    with pytest.raises(TypeError, match="token-mean cross entropy"):
        tt.hand_head_to_tile_pass(recipe)
    assert "unembed" not in recipe._model.__dict__  # the model is left as it was
