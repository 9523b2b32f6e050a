"""DeepSpeed measurements for docs/stacks.md: the loss recipe each ZeRO stage's gradient
reduction needs, the report per stage, and tile_pass beside DeepSpeed's ``TiledFusedLogitsLoss``.

    python scripts/deepspeed_bench.py recipes            # 2 gloo ranks, eager engines: grad / one process
    python scripts/deepspeed_bench.py recipes --reports  # the same through compile_engine: the reports
    python scripts/deepspeed_bench.py loss               # peak memory, time, gradient errors of head + loss

``recipes``: a tiny transformers Llama, DeepSpeed 0.19 on CPU (``DS_ACCELERATOR=cpu``, gloo), 2
ranks as data parallelism (a row each) or as one Ulysses sequence-parallel group (half the
sequence each), ZeRO stages 0-3, one step; each rank backpropagates ``local token sum / global
valid count``, times 1 or times the world size. Printed: the lm_head gradient DeepSpeed reduced
(``safe_get_full_grad``) over one float64 process on the whole batch, and the worst relative
error over every parameter's gradient. Ranks have uneven valid counts.

``loss``: one training step of ``cross_entropy(hidden @ W.T, labels, reduction="sum") / valid``
(a quarter of the labels ignored) on CPU in float32, each implementation in a fresh process
(:func:`tile_pass._measure.run_fresh`): eager; tile_pass (``torch.compile``, inner aot_eager and
inductor); DeepSpeed's ``TiledFusedLogitsLoss`` as ALST's callers use it (``output_reduction=
"sum"``, then divided by the valid count), with as many shards as tile_pass has tiles. Peak is
``VmHWM`` above the resident size before the step; time is the median step after warm-up;
errors are the worst element of each gradient against float64 eager, relative to its largest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, SEQ, ROWS, LR = 512, 24, 2, 0.5


# --- recipes ------------------------------------------------------------------------------


def tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def global_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3:15] = -100  # uneven valid counts per row and per sequence half
    return ids, F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()


def _one_step(rank, world, stage, sp, factor, mpu, compiled):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from tile_pass.integrations.deepspeed import compile_engine

    torch._dynamo.reset()  # each run compiles afresh (ZeRO-3's hooks exhaust recompile limits)
    model = tiny_llama()
    config = {
        "train_micro_batch_size_per_gpu": ROWS if sp else ROWS // world,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    backend = compile_engine(engine, "aot_eager", tile_tokens=8) if compiled else None
    ids, labels = global_batch()
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    part = (slice(None), slice(rank * SEQ // world, (rank + 1) * SEQ // world)) if sp else (
        slice(rank * ROWS // world, (rank + 1) * ROWS // world),)  # fmt: skip
    ids, labels, positions = (t[part].contiguous() for t in (ids, labels, positions))
    count = global_batch()[1].ne(-100).sum()
    out = engine(
        input_ids=ids, labels=labels, shift_labels=labels, position_ids=positions, num_items_in_batch=count
    )
    engine.backward(out.loss * factor)
    grads = {n: safe_get_full_grad(p).detach().double().clone() for n, p in engine.module.named_parameters()}
    report = str(backend.report()) if backend is not None else None
    engine.destroy()
    return grads, report


def _recipes_worker(rank, world, port, compiled, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import logging

    import deepspeed
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    transformers.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # inference-only JIT op
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=tiny_llama(), core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=ROWS, seq_length_is_variable=True,
    )  # fmt: skip
    ulysses = ALL_ATTENTION_FUNCTIONS["sdpa"]
    results = {}
    for sp in (False, True):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses if sp else sdpa
        for stage in (0, 1, 2, 3):
            for factor in (1, world):
                if compiled and factor != 1:
                    continue
                results[(sp, stage, factor)] = _one_step(
                    rank, world, stage, sp, factor, mpu if sp else None, compiled
                )
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def eager_grads():
    model = tiny_llama().double()
    ids, labels = global_batch()
    model(input_ids=ids, labels=labels, shift_labels=labels).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def recipes(compiled: bool) -> None:
    import torch.multiprocessing as mp

    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _recipes_worker, args=(world, port, compiled, out), nprocs=world, start_method="spawn"
        )
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    ref = eager_grads()
    head = ref["lm_head.weight"]
    print("| layout | ZeRO stage | each rank backpropagates | lm_head grad / one process | worst error |")
    print("|---|---|---|---|---|")
    for (sp, stage, factor), (grads, report) in ranks[0].items():
        ratio = (grads["lm_head.weight"] * head).sum() / (head * head).sum()
        error = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref.items())
        layout = "Ulysses SP, 2 ranks" if sp else "data parallel, 2 ranks"
        recipe = "local sum / global count" + (f" x {factor}" if factor != 1 else "")
        print(f"| {layout} | {stage} | {recipe} | {ratio.item():.4f} | {error:.1e} |")
        if report is not None:
            print(report.replace("\n", "\n    "))


# --- loss ---------------------------------------------------------------------------------


def _problem(tokens, hidden, vocab, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::4] = -100
    return x, w, labels


def _head_and_loss(x, w, labels):
    return F.cross_entropy(F.linear(x, w).float(), labels, reduction="sum")


def _implementation(name, tiles, tokens):
    """``fn(x, w, labels) -> loss / valid`` for one implementation."""
    if name == "eager":
        return lambda x, w, y: _head_and_loss(x, w, y) / y.ne(-100).sum()
    if name.startswith("tile_pass"):
        import tile_pass

        inner = name.split(":")[1]
        compiled = torch.compile(
            _head_and_loss, backend=tile_pass.backend(inner, tile_tokens=tokens // tiles)
        )
        return lambda x, w, y: compiled(x, w, y) / y.ne(-100).sum()
    from types import SimpleNamespace

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    head = SimpleNamespace(weight=None)

    def shard(module, x, y):
        return _head_and_loss(x, module.weight, y)

    def loss(x, w, y):
        head.weight = w
        summed = TiledFusedLogitsLoss.apply(
            shard, head, x.unsqueeze(0), y.unsqueeze(0), None, tiles, [w], "sum"
        )
        return summed / y.ne(-100).sum()

    return loss


def measure_one(args) -> dict:
    from tile_pass import _measure

    x, w, labels = _problem(args.tokens, args.hidden, args.vocab, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    fn = _implementation(args.impl, args.tiles, args.tokens)
    step = _measure.training_step(fn, x, w, labels)
    step()  # compile, warm up
    measured = _measure.measure_steps(step, torch.device("cpu"), args.repeats)
    step()
    got = (w.grad.double(), x.grad.double())
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (_head_and_loss(x64, w64, labels) / labels.ne(-100).sum()).backward()
    errors = [
        ((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, (w64.grad, x64.grad), strict=True)
    ]
    return {
        "impl": args.impl,
        "peak_mib": measured.peak_above / _measure.MiB,
        "step_s": measured.times[len(measured.times) // 2],
        "w_grad_error": errors[0],
        "x_grad_error": errors[1],
        "loss": measured.loss.item(),
    }


def loss_table(args) -> None:
    from tile_pass import _measure

    logits_mib = args.tokens * args.vocab * 4 / _measure.MiB
    print(f"N={args.tokens} H={args.hidden} V={args.vocab} float32, {args.tiles} tiles/shards, "
          f"a quarter of the labels ignored; float32 logits {logits_mib:.0f} MiB")  # fmt: skip
    print("| implementation | peak above inputs MiB | step s | lm_head grad error | hidden grad error |")
    print("|---|---|---|---|---|")
    for impl in args.impls.split(","):
        argv = [__file__, "_one", "--impl", impl, *(f"--{k}={getattr(args, k)}" for k in
                ("tokens", "hidden", "vocab", "tiles", "repeats"))]  # fmt: skip
        r = _measure.run_fresh(argv)
        print(f"| {impl} | {r['peak_mib']:.0f} | {r['step_s']:.2f} | {r['w_grad_error']:.1e} | "
              f"{r['x_grad_error']:.1e} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["recipes", "loss", "_one"])
    parser.add_argument("--reports", action="store_true", help="via compile_engine, aot_eager")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", default="eager,tile_pass:aot_eager,tile_pass:inductor,deepspeed")
    parser.add_argument("--impl")
    args = parser.parse_args()
    if args.what == "recipes":
        recipes(args.reports)
    elif args.what == "loss":
        loss_table(args)
    else:
        print(json.dumps(measure_one(args)))


if __name__ == "__main__":
    main()
