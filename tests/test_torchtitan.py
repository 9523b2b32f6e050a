"""torchtitan's training step on a tiny Llama 3 built from torchtitan's own config
(``llama3_debugmodel``, one layer): its shipped ``ChunkedLossWrapper`` against the same step
with ``--override.imports tile_pass.integrations.torchtitan.tiled_loss`` applied by torchtitan's
own override mechanism: rewritten per the backend's report, and the loss and every parameter's
gradient (``lm_head``'s included) equal (float32, CPU, gloo, ``inner="aot_eager"``); on 1 rank,
and on 2 gloo ranks with the head sharded over the vocabulary (tensor parallelism,
``spmd_backend="partial_dtensor"``) and with FSDP2 sharding every parameter (``dp_shard=2``).

Changes to the shipped config, none near the head: FlexAttention (torch has no CPU backward for
it) becomes torchtitan's SDPA module with causal masking (one document per row), and the
parameters stay float32 (``mixed_precision_param``). torchtitan builds its device mesh on its
detected accelerator type ("cuda" when there is none), so the tests build it on "cpu"; gloo has
no ``PREMUL_SUM``, so FSDP2 reduces by a plain sum (``set_force_sum_reduction_for_comms``; the
divide factor torchtitan sets is 1.0, so the sum is the same reduction). The model and the loss
are built as ``Trainer.__init__`` builds them; the step is the trainer's own
``post_dataloading_process`` and ``_forward_backward_body``.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is not installed")
from test_distributed import _free_port, spawn  # noqa: E402
from test_tensor_parallel import _process_group  # noqa: E402

from tile_pass.integrations import torchtitan as titan  # noqa: E402  (before torchtitan's models)

SEQ, BATCH, TILE = 32, 2, 16
OVERRIDE = "tile_pass.integrations.torchtitan.tiled_loss"


@pytest.fixture(autouse=True, scope="module")
def _torchtitan_models_import():
    """torchtitan 0.3.0's models need torch>=2.12 (FSDP's DataParallelMeshDims), and the torchao 0.15
    they import (torchtune 0.6.1 needs <0.16) does not load beside triton 3.9 (torch 2.15's CUDA
    wheels): there, every case here skips with the reason (imported here, not at collection, as the
    tests import them)."""
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401
    except (ImportError, ValueError) as why:
        pytest.skip(f"torchtitan's models do not import with torch {torch.__version__}: {why}")


def _config(tiled: bool, *, tp: int = 1, spmd_backend: str = "spmd_types", ce_loss: bool = False,
            compile_model: bool = False):  # fmt: skip
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel, llama3_debugmodel_ce_loss

    config = llama3_debugmodel_ce_loss() if ce_loss else llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:1]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"
    config.parallelism.tensor_parallel_degree = tp
    config.parallelism.spmd_backend = spmd_backend
    config.compile.enable = compile_model
    config.compile.backend = "aot_eager"
    if tiled:  # what the trainer does with --override.imports
        config.override = OverrideConfig(imports=[(OVERRIDE, {"tile_tokens": TILE})])
        apply_overrides(config.override, config)
    return config


def _build(config, world: int):
    """The model and loss as torchtitan's Trainer.__init__ builds them (meta init,
    parallelize_fn, init_weights, the loss from its config, the lm_head hand-off)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=None, dump_folder="",
    )  # fmt: skip
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    for module in model.modules():  # gloo has no PREMUL_SUM; torchtitan's divide factor is 1.0
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # Trainer.__init__, no pipeline parallelism
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    return model, loss_fn, context, parallel_dims


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100
    return tokens, labels


def _whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _step(config, world: int) -> dict:
    """One forward-backward as the trainer's ``forward_backward_step`` runs it (its input
    processing, then its step body); the loss and every parameter's gradient."""
    from torchtitan.trainer import Trainer

    model, loss_fn, context, parallel_dims = _build(config, world)
    tokens, labels = _batch()
    gvt = (labels != -100).sum()
    trainer = types.SimpleNamespace(
        model_parts=[model], loss_fn=loss_fn, train_context=context, config=config,
        model_config=config.model_spec.model, parallel_dims=parallel_dims, ntokens_seen=0,
    )  # fmt: skip
    inputs, labels, extra_kwargs = Trainer.post_dataloading_process(trainer, {"input": tokens}, labels)
    loss = Trainer._forward_backward_body(trainer, inputs, labels, gvt, extra_kwargs)
    result = {
        "loss": _whole(loss.detach()),  # ChunkedLossWrapper's is a DTensor when its input is one
        "grad": _whole(model.lm_head.weight.grad),
        "grads": {name: _whole(p.grad) for name, p in model.named_parameters()},
        "loss_type": type(loss_fn).__name__,
    }
    if isinstance(loss_fn, titan.TiledCrossEntropyLoss):
        result["report"] = titan.report(loss_fn)
    return result


@pytest.fixture
def one_rank():
    with _process_group(0, _free_port(), world=1):
        yield
    torch._dynamo.reset()


def _assert_same(result, reference):
    torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["grad"], reference["grad"], rtol=1e-4, atol=1e-6)
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_override_tiles_the_head_and_matches_the_shipped_chunked_loss(one_rank):
    shipped = _step(_config(tiled=False), 1)
    assert shipped["loss_type"] == "ChunkedLossWrapper"
    tiled = _step(_config(tiled=True), 1)
    assert tiled["loss_type"] == "TiledCrossEntropyLoss"
    rewrites = tiled["report"].rewrites
    assert len(rewrites) == 1, str(tiled["report"])
    form = rewrites[0].form  # the cross-entropy chain's, or the row-wise region's
    assert "cross_entropy" in form and "ignore_index=-100" in form, form
    assert rewrites[0].reduction.startswith("sum"), rewrites[0]
    assert rewrites[0].num_tiles == BATCH * SEQ // TILE
    _assert_same(tiled, shipped)


def test_compile_backend_tile_pass_alone_sees_no_head(one_rank):
    """Why the loss is needed: with the plain CrossEntropyLoss and compile.backend="tile_pass",
    torchtitan compiles the loss on its own; its graph receives the logits, and is skipped."""
    import tile_pass

    config = _config(tiled=False, ce_loss=True)
    config.compile.enable = True
    config.compile.components = ["loss"]
    backend = tile_pass.backend("aot_eager")
    config.compile.backend = backend
    result = _step(config, 1)
    assert result["loss_type"] == "CrossEntropyLoss"
    report = backend.report()
    assert not report.rewrites
    assert report.skipped and "logits are an input" in report.skipped[0].reason, str(report)


@pytest.mark.slow
def test_with_the_blocks_compiled(one_rank):
    """compile.enable with "model" and "loss": the blocks compiled one by one (aot_eager), the
    tiled loss compiled with the same inner compiler."""
    shipped = _step(_config(tiled=False), 1)
    tiled = _step(_config(tiled=True, compile_model=True), 1)
    assert len(tiled["report"].rewrites) == 1, str(tiled["report"])
    _assert_same(tiled, shipped)


def test_the_documented_command_line_reaches_the_loss():
    """torchtitan's own CLI parser (ConfigManager, as ``torchtitan.train`` runs it) and the
    trainer's apply_overrides: the config's loss becomes the tiled one."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.config.override import apply_overrides

    config = ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports", OVERRIDE]
    )
    assert config.override.imports == [OVERRIDE]
    apply_overrides(config.override, config)  # Trainer.__init__
    assert type(config.loss) is titan.TiledCrossEntropyLoss.Config
    config = ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel",
         "--override.imports", OVERRIDE + '={"tile_tokens": 16, "inner": "aot_eager"}']
    )  # fmt: skip
    apply_overrides(config.override, config)
    assert (config.loss.tiling.tile_tokens, config.loss.inner) == (16, "aot_eager")


def test_the_override_refuses_a_loss_it_does_not_replace():
    from torchtitan.components.loss import MSELoss

    with pytest.raises(ValueError, match="replaces a cross entropy loss"):
        titan.tiled_loss(MSELoss.Config())


# ---------------------------------------------- the head sharded over the vocabulary, 2 ranks


TWO_RANK_CASES = {  # name: _config's keyword arguments
    "tp": {"tp": 2, "spmd_backend": "partial_dtensor"},  # lm_head's weight a DTensor, Shard(0)
    "fsdp": {"spmd_backend": "partial_dtensor"},  # dp_shard=-1 (2): the head all-gathered by FSDP2
}


def _two_rank_worker(rank, port, outdir):
    with _process_group(rank, port, world=2):
        results = {}
        for case, kwargs in TWO_RANK_CASES.items():
            for tiled in (False, True):
                result = _step(_config(tiled=tiled, **kwargs), 2)
                if "report" in result:
                    result["report"] = result["report"].to_dict()
                results[case, "tiled" if tiled else "shipped"] = result
            torch._dynamo.reset()
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every two-rank case in one pair of spawned processes (torchtitan's import costs seconds)."""
    outdir = tmp_path_factory.mktemp("titan2")
    spawn(_two_rank_worker, (_free_port(), str(outdir)))
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_vocabulary_sharded_head_on_two_ranks(two_ranks):
    for results in two_ranks:
        tiled, shipped = results["tp", "tiled"], results["tp", "shipped"]
        assert tiled["loss_type"] == "TiledCrossEntropyLoss"
        rewrites = tiled["report"]["rewrites"]
        assert len(rewrites) == 1 and "tensor-parallel: degree 2" in rewrites[0]["form"], tiled["report"]
        _assert_same(tiled, shipped)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_fsdp_on_two_ranks(two_ranks):
    for results in two_ranks:
        tiled, shipped = results["fsdp", "tiled"], results["fsdp", "shipped"]
        assert len(tiled["report"]["rewrites"]) == 1, tiled["report"]
        _assert_same(tiled, shipped)
