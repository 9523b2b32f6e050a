"""DeepSpeed engines (ZeRO stages 0-3, Ulysses sequence parallelism) with tile_pass, on CPU
with gloo (``DS_ACCELERATOR=cpu``), a tiny transformers Llama from a config.

Every case spawns its ranks, trains ``STEPS`` SGD steps through ``deepspeed.initialize`` and
``compile_engine(engine, "aot_eager")`` (the one line, any stage), and sends back per step the
global loss, every parameter's full reduced gradient (``deepspeed.utils.safe_get_full_grad``)
and the backend's report. The parent checks: the head rewritten in one graph on every rank;
loss and gradients equal to the same engine compiled with plain ``aot_eager`` (at stage 3
without the helper: DeepSpeed's own path, its ZeRO hooks and ``LinearFunctionForZeroStage3``);
and equal to one process in float64 eager on the whole batch, with the loss recipe that
matches the stage's gradient reduction (:func:`recipe_factor`). Ranks get uneven numbers of
valid tokens, so a mean of per-rank means would fail the last check.

The default run holds Ulysses sequence parallelism on 2 ranks at ZeRO stage 3 (the helper and
the sequence-parallel loss in one case); ``-m slow`` adds stages 0-3 on 1 and on 2
data-parallel ranks and Ulysses at stages 0-2.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import sys
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import DEVICES  # noqa: E402
from test_distributed import _free_port, spawn  # noqa: E402

try:
    import deepspeed  # noqa: F401
    import transformers
except Exception as e:  # an ImportError, or a DeepSpeed that fails to set itself up here
    pytest.skip(f"deepspeed cannot be imported: {type(e).__name__}: {e}", allow_module_level=True)

from packaging.version import Version  # noqa: E402

import tile_pass  # noqa: E402
from tile_pass.integrations.deepspeed import compile_engine, hand_head_to_tile_pass  # noqa: E402

VOCAB, SEQ, ROWS, STEPS, LR = 512, 24, 2, 2, 0.5
WORLD = 2
SPAWN_TIMEOUT_S = 600
DEEPSPEED = Version(importlib.metadata.version("deepspeed"))


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
        attn_implementation="sdpa",  # Ulysses wraps sdpa; the other cases use it too
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def global_batch():
    """Token ids and the shifted labels of the whole batch; row 0 loses most of its labels in
    its first half, so ranks (rows or sequence halves) have uneven valid counts."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3:15] = -100
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    return ids, shift_labels


def rank_batch(rank, world, sp):
    """This rank's part: a sequence shard of every row (sp), else its rows; with positions."""
    ids, shift_labels = global_batch()
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    if sp:
        part = (slice(None), slice(rank * SEQ // world, (rank + 1) * SEQ // world))
    else:
        part = (slice(rank * ROWS // world, (rank + 1) * ROWS // world),)
    return [t[part].contiguous() for t in (ids, shift_labels, positions)]


def recipe_factor(stage, sp, world):
    """The factor on ``sum over the rank's tokens / global valid count`` that makes DeepSpeed's
    reduced gradient equal one process on the whole batch (docs/stacks.md, measured by
    scripts/deepspeed_bench.py): DeepSpeed averages over data-parallel ranks at every stage;
    over a Ulysses group it sums at stages 0-2 and, before 0.20.2, averages at stage 3."""
    if not sp:
        return world
    return world if stage == 3 and DEEPSPEED < Version("0.20.2") else 1


def _train(rank, world, stage, sp, backend_name, mpu):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad

    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": ROWS if sp else ROWS // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},  # partition all
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    backend = None
    if backend_name == "tile_pass":
        backend = compile_engine(engine, "aot_eager", tile_tokens=8)
    else:
        engine.compile(backend=backend_name)
    ids, shift_labels, positions = rank_batch(rank, world, sp)
    count = global_batch()[1].ne(-100).sum()
    factor = recipe_factor(stage, sp, world)
    head = engine.module.lm_head.weight
    losses, grads, head_states = [], [], []
    for _ in range(STEPS):
        out = engine(input_ids=ids, labels=shift_labels, shift_labels=shift_labels, position_ids=positions,
                     num_items_in_batch=count)  # fmt: skip
        if stage == 3:  # after the forward: released, or kept for the backward by ZeRO's trace
            head_states.append((head.ds_status == ZeroParamStatus.NOT_AVAILABLE, head.numel()))
        engine.backward(out.loss * factor)
        grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()})
        loss = out.loss.detach().clone()
        torch.distributed.all_reduce(loss)  # sum of (rank's sum / global count): the global mean
        losses.append(loss.item())
        engine.step()
        if stage == 3:
            head_states.append((head.ds_status == ZeroParamStatus.NOT_AVAILABLE, head.numel()))
    report = backend.report().to_dict() if backend is not None else None
    engine.destroy()
    return {"losses": losses, "grads": grads, "report": report, "head_states": head_states}


def _worker(rank, world, port, runs, outdir):
    """Each ``(stage, sp, backend)`` in turn, in one process group. A ZeRO-3 engine rebinds
    torch.nn.functional.linear for the rest of the process (later engines at stages 0-2 have
    DeepSpeed's linear too), and Ulysses takes over the "sdpa" attention: the data-parallel runs
    get transformers' own sdpa back."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce for inference
    # (inference_all_reduce) when it starts; training here uses gloo's collectives only
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa, ulysses, mpu = ALL_ATTENTION_FUNCTIONS["sdpa"], None, None
    try:
        for stage, sp, backend_name in runs:
            if sp and mpu is None:
                from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

                mpu = UlyssesSPAttentionHF.register_with_transformers(
                    model_name_or_path=tiny_llama(), core_attn_implementation="sdpa",
                    sequence_parallel_size=world, micro_batch_size=ROWS, seq_length_is_variable=True,
                )  # fmt: skip
                ulysses = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses if sp else sdpa
            torch._dynamo.reset()  # each run compiles afresh (ZeRO-3's hooks exhaust recompile limits)
            result = _train(rank, world, stage, sp, backend_name, mpu if sp else None)
            torch.save(result, os.path.join(outdir, f"{run_name(stage, sp, backend_name)}_rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def run_name(stage, sp, backend_name):
    return f"{'ulysses' if sp else 'dp'}_z{stage}_{backend_name}"


def eager_reference():
    """One process, no DeepSpeed, float64 eager on the whole batch: losses and gradients."""
    model = tiny_llama().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, shift_labels = global_batch()
    losses, grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=shift_labels, shift_labels=shift_labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads


def run(tmp_path, world, cases):
    """``cases``: ``(stage, sp)`` pairs; each runs with tile_pass and with plain aot_eager.
    Returns ``{(stage, sp, backend): [result of each rank]}``."""
    runs = [(stage, sp, b) for stage, sp in cases for b in ("tile_pass", "aot_eager")]
    spawn(_worker, (world, _free_port(), runs, str(tmp_path)), timeout=SPAWN_TIMEOUT_S, nprocs=world)
    return {r: [torch.load(tmp_path / f"{run_name(*r)}_rank{k}.pt") for k in range(world)] for r in runs}


def assert_grads(got, expected, where, **tolerances):
    for name, ref in expected.items():
        torch.testing.assert_close(got[name].to(ref.dtype), ref, **tolerances,
                                   msg=lambda m, n=name: f"{where}, {n}: {m}")  # fmt: skip


def check(results, world, stage, sp):
    ref_losses, ref_grads = eager_reference()
    tokens = ROWS * SEQ // world
    tiled_ranks, plain_ranks = results[(stage, sp, "tile_pass")], results[(stage, sp, "aot_eager")]
    for rank, (tiled, plain) in enumerate(zip(tiled_ranks, plain_ranks, strict=True)):
        where = f"{run_name(stage, sp, 'tile_pass')} rank {rank}"
        rewrites = tiled["report"]["rewrites"]
        assert len(rewrites) == 1 and not tiled["report"]["skipped"], (where, tiled["report"])
        assert (rewrites[0]["num_tokens"], rewrites[0]["vocab_size"]) == (tokens, VOCAB), rewrites[0]
        assert rewrites[0]["num_tiles"] > 1, rewrites[0]
        torch.testing.assert_close(tiled["losses"], plain["losses"], rtol=1e-6, atol=1e-6, msg=where)
        torch.testing.assert_close(tiled["losses"], ref_losses, rtol=1e-5, atol=1e-6, msg=where)
        for step in range(STEPS):
            at = f"{where} step {step} vs"
            assert_grads(tiled["grads"][step], plain["grads"][step], f"{at} aot_eager", rtol=1e-5, atol=1e-7)
            assert_grads(tiled["grads"][step], ref_grads[step], f"{at} eager", rtol=1e-4, atol=1e-6)
        if stage == 3:  # ZeRO gathers and releases the head weight where its own hooks do
            assert tiled["head_states"] == plain["head_states"], (tiled["head_states"], plain["head_states"])
            assert all(released for released, _ in tiled["head_states"][1::2]), tiled["head_states"]
            if world > 1:  # partitioned between steps: no rank holds the whole weight
                assert all(numel == 0 for _, numel in tiled["head_states"][1::2]), tiled["head_states"]


def test_ulysses_zero3_rewritten_and_exact(tmp_path):
    """The default run's sample, both ZeRO-3 and Ulysses: 2 ranks, one sequence-parallel group."""
    check(run(tmp_path, WORLD, [(3, True)]), WORLD, 3, True)


@pytest.mark.slow
@pytest.mark.parametrize("world, cases", [
    # ZeRO-3 first: stages 0-2 then run with DeepSpeed's linear in place of torch's (see _worker)
    (1, [(3, False), (0, False), (1, False), (2, False)]),
    (WORLD, [(0, False), (1, False), (2, False), (3, False)]),
    (WORLD, [(0, True), (1, True), (2, True)]),
], ids=["one_rank_zero3012", "two_ranks_zero0123", "ulysses_zero012"])  # fmt: skip
def test_every_stage_rewritten_and_exact(tmp_path, world, cases):
    results = run(tmp_path, world, cases)
    for stage, sp in cases:
        check(results, world, stage, sp)


# --- in this process: the helper's errors, DeepSpeed's own tiled loss ------------------


def test_helper_names_a_head_it_cannot_take():
    engine = types.SimpleNamespace(module=torch.nn.Module())
    with pytest.raises(ValueError, match="get_output_embeddings"):
        hand_head_to_tile_pass(engine)
    with pytest.raises(TypeError, match="torch.nn.Linear, got Embedding"):
        hand_head_to_tile_pass(engine, torch.nn.Embedding(4, 2))


def _head_and_loss(hidden, weight, labels):
    return torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum")


@pytest.mark.parametrize("device", DEVICES)
def test_deepspeeds_tiled_fused_logits_loss_ignores_the_upstream_gradient(device):
    """The claim docs/stacks.md measures: DeepSpeed's ``TiledFusedLogitsLoss`` (its backward
    written by hand) accumulates the head's gradient during the forward as if the loss were
    used unscaled, so ``loss / valid_count`` (how ALST's callers average it) leaves the head
    gradient ``valid_count`` times too large; tile_pass's, derived, equals eager's."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    g = torch.Generator().manual_seed(0)
    n, h, v = 48, 16, 64
    hidden = torch.randn(1, n, h, generator=g).to(device)
    weight = (torch.randn(v, h, generator=g) * 0.1).to(device)
    labels = torch.randint(0, v, (1, n), generator=g).to(device)
    labels[0, ::3] = -100
    valid = int(labels.ne(-100).sum())

    def grads(loss_of):
        w = weight.clone().requires_grad_()
        x = hidden.clone().requires_grad_()
        (loss_of(x, w) / valid).backward()
        return w.grad, x.grad

    head = types.SimpleNamespace(weight=None)

    def shard_loss(module, x, y):
        return _head_and_loss(x, module.weight, y)

    def deepspeed_loss(x, w):
        head.weight = w
        return TiledFusedLogitsLoss.apply(shard_loss, head, x, labels, None, 4, [w], "sum")

    eager_w, eager_x = grads(lambda x, w: _head_and_loss(x.view(n, h), w, labels.view(n)))
    ds_w, ds_x = grads(deepspeed_loss)
    tiled = torch.compile(_head_and_loss, backend=tile_pass.backend("aot_eager", tile_tokens=8))
    tp_w, tp_x = grads(lambda x, w: tiled(x.view(n, h), w, labels.view(n)))
    torch.testing.assert_close(tp_w, eager_w)
    torch.testing.assert_close(tp_x, eager_x)
    torch.testing.assert_close(ds_x, eager_x)  # the hidden gradient is scaled by the upstream one
    torch.testing.assert_close(ds_w, eager_w * valid)  # the head's is not
