"""The logits never exist whole: checked in the compiled graphs and in a measured step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import tile_pass
from tile_pass._measure import lm_head_loss, run_fresh
from tile_pass.bench import BenchConfig, measure_fresh
from tile_pass.report import _fmt_bytes

N, H, V = 256, 8, 1000


def head(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def capture_graphs():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def largest_tensor(graphs):
    sizes = [
        n.meta["val"].numel()
        for gm in graphs
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    return max(sizes)


def run(fn, requires_weight_grad=True):
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=requires_weight_grad)
    y = torch.randint(0, V, (N,))
    fn(h, w, y).backward()


def test_no_logits_sized_tensor_in_forward_or_backward_graph():
    graphs, inner = capture_graphs()
    run(torch.compile(head, backend=tile_pass.backend(inner, tile_tokens=16, compile_tiles=False)))
    assert len(graphs) == 2  # forward and backward
    assert largest_tensor(graphs) < N * V / 8

    plain_graphs, plain = capture_graphs()  # the same check sees the logits without the pass
    run(torch.compile(head, backend=plain))
    assert largest_tensor(plain_graphs) >= N * V


def test_no_host_sync_in_rewritten_graph():
    graphs, inner = capture_graphs()
    run(
        torch.compile(
            head, backend=tile_pass.backend(inner, tile_tokens=16, compile_tiles=False), fullgraph=True
        )
    )
    syncing = {"aten.item", "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select"}
    targets = {str(n.target).rsplit(".", 1)[0] for gm in graphs for n in gm.graph.nodes}
    assert "tile_pass.row_region_loss" in targets
    assert not targets & syncing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_at_run_time_cuda():
    h = torch.randn(N, H, device="cuda", requires_grad=True)
    w = torch.randn(V, H, device="cuda", requires_grad=True)
    y = torch.randint(0, V, (N,), device="cuda")
    fn = torch.compile(head, backend=tile_pass.backend("aot_eager", tile_tokens=16))
    fn(h, w, y).backward()  # compile and trace the tile kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(h, w, y).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_frozen_weight_gets_no_gradient_work():
    graphs, inner = capture_graphs()
    run(
        torch.compile(head, backend=tile_pass.backend(inner, compile_tiles=False)), requires_weight_grad=False
    )
    calls = [
        n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.tile_pass.row_region_loss.default
    ]
    assert len(calls) == 1
    schema = torch.ops.tile_pass.row_region_loss.default._schema
    args = {**dict(zip([a.name for a in schema.arguments], calls[0].args, strict=False)), **calls[0].kwargs}
    assert args["need"][:3] == [True, False, False]  # hidden, weight, bias


def _measure(cfg: BenchConfig) -> dict:
    """One step of ``cfg`` in a fresh process, as the benchmark measures it (``inner`` under
    both sides: plain ``torch.compile`` and tile_pass)."""
    row = measure_fresh(cfg, timeout=900, warm_cache=True)
    assert "error" not in row, row
    return row


def _gradients_mib(tokens: int, hidden: int, vocab: int) -> float:
    """The float32 weight and hidden-state gradients one step returns, in MiB."""
    return (vocab + tokens) * hidden * 4 / 2**20


def test_measured_peak_memory_drops_by_the_logits():
    """One training step in a fresh process: N=4096, H=256, V=32000 fp32 (logits 500 MiB); the
    drop is the one ``explain`` reports for an unfused inner compiler, within 5%."""
    shape = dict(tokens=4096, hidden=256, vocab=32000, inner="aot_eager", repeats=1, check=False)
    plain = _measure(BenchConfig(impl="inductor", **shape))
    tiled = _measure(BenchConfig(impl="tile_pass", tile_bytes=64 * 2**20, **shape))
    assert abs(plain["loss"] - tiled["loss"]) < 1e-4 * abs(plain["loss"])
    assert plain["peak_mib"] > 2 * plain["logits_mib"]
    # the step's own gradients (dW, dh: 35 MiB) are part of its measured peak (the bench drops the
    # previous step's before the peak step, since 07e1118): a third of the logits besides them
    assert tiled["peak_mib"] < plain["logits_mib"] / 3 + _gradients_mib(4096, 256, 32000), (plain, tiled)

    # the report's figure: aot_eager's backward holds the saved log-probabilities, nll_loss's
    # gradient and the logits gradient at once (3 x 500 MiB); the tiles hold their buffers instead,
    # and the weight's and hidden states' gradients, formed during the loop (after an unfused
    # step's peak). Measured 2.9% below it (other small buffers of the two steps); 5% is the tolerance
    h = torch.randn(4096, 256, requires_grad=True)
    w = torch.randn(32000, 256, requires_grad=True)
    y = torch.randint(0, 32000, (4096,))
    report = tile_pass.backend("aot_eager", tile_bytes=64 * 2**20).explain(lm_head_loss, h, w, y)
    (rewrite,) = report.rewrites
    assert rewrite.tile_tokens == tiled["tile_tokens"], (rewrite, tiled)
    sizes = rewrite.logits_bytes
    assert sizes["logits"] == sizes["saved_log_probs"] == sizes["loss_grad"] == 4096 * 32000 * 4
    predicted = rewrite.peak_bytes_avoided["unfused"] / 2**20
    assert predicted == 3 * 500 - (rewrite.tile_buffer_bytes + rewrite.grad_buffer_bytes) / 2**20
    assert rewrite.grad_buffer_bytes == 32000 * 256 * 4 + 4096 * 256 * 4  # dW's float32 sum, dh
    measured = plain["peak_mib"] - tiled["peak_mib"]
    print(f"peak drop measured {measured:.1f} MiB, reported {predicted:.1f} MiB")
    assert abs(measured - predicted) < 0.05 * predicted, (measured, predicted, plain, tiled)
    assert f"{_fmt_bytes(rewrite.peak_bytes_avoided['unfused'])} lower than an unfused step's" in str(rewrite)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _finetune_child(mode, inner, vocab, tokens):
    script = str(EXAMPLES / "finetune_tiny_lm.py")
    argv = [script, "--child", mode, "--inner", inner, "--vocab", str(vocab), "--tokens", str(tokens)]
    return run_fresh([*argv, "--steps", "1"])


def _check_causal_lm_step(inner, vocab, tokens):
    pytest.importorskip("transformers")
    plain = _finetune_child("torch.compile", inner, vocab, tokens)
    exact = _finetune_child("tile_pass", inner, vocab, tokens)
    dropped = _finetune_child("tile_pass drop_logits", inner, vocab, tokens)
    logits_mib = tokens * vocab * 4 / 2**20
    for result in (exact, dropped):
        assert result["rewrites"] == 1
        for a, b in zip(result["losses"], plain["losses"], strict=True):
            assert abs(a - b) < 1e-4 * abs(b)
    # the returned model-dtype logits stay; their upcast, softmax and gradient do not
    assert exact["peak_mib"] < plain["peak_mib"] - logits_mib, (plain, exact)
    # dropping the returned logits saves them too
    assert dropped["peak_mib"] < exact["peak_mib"] - 0.75 * logits_mib, (exact, dropped)
    # and keeping them costs them alone: no second [N, V] buffer (the token weights' derivation
    # once allocated zeros for every output, the returned logits included)
    assert exact["peak_mib"] < dropped["peak_mib"] + 1.5 * logits_mib, (exact, dropped)
    return plain, exact, dropped


def test_causal_lm_training_step_memory():
    """A real HF Llama step (V=32000, 2048 tokens, logits 250 MiB), each side in a fresh process."""
    _check_causal_lm_step("aot_eager", 32000, 2048)


@pytest.mark.slow
def test_causal_lm_training_step_memory_inductor_large_vocab():
    """The issue's shape: V=65536, 4096 tokens (fp32 logits 1 GiB), inner compiler inductor."""
    _check_causal_lm_step("inductor", 65536, 4096)


@pytest.mark.parametrize("form", ["ce_zloss", "grpo"])
def test_measured_peak_memory_of_multi_read_forms_is_flat_in_tokens(form):
    """CE + z-loss and a GRPO-style log-prob step (the logits read twice / by log_softmax +
    gather), one fresh process each: a fraction of the logits (plain compilation holds them
    twice over: test_measured_peak_memory_drops_by_the_logits), and the extra memory of doubling
    N is the doubled inputs, not doubled logits."""
    shape = dict(hidden=256, vocab=32000, inner="aot_eager", repeats=1, form=form, check=False)
    tiled = _measure(BenchConfig(impl="tile_pass", tile_bytes=64 * 2**20, tokens=4096, **shape))
    doubled = _measure(BenchConfig(impl="tile_pass", tile_bytes=64 * 2**20, tokens=8192, **shape))
    logits_mib = tiled["logits_mib"]
    assert tiled["fired"] and doubled["fired"], (tiled, doubled)
    assert tiled["peak_mib"] < logits_mib / 3 + _gradients_mib(4096, 256, 32000), tiled  # as above
    assert doubled["peak_mib"] - tiled["peak_mib"] < logits_mib / 4, (tiled, doubled)
