"""Seeing and trusting the rewrite: reports, dumps, logging, decorator, validation, CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import V

import tile_pass
from tile_pass.tiles.tiled_region import _loss_setup_context, _loss_vjp, _row_region_loss


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 9, models.H, generator=g, requires_grad=True)
    w = torch.randn(V, models.H, generator=g, requires_grad=True)
    y = torch.randint(0, V, (2, 9), generator=g)
    y[0, :4] = -100
    return h, w, y


class TwoHeads(nn.Module):
    """A model with two LM heads (e.g. main + auxiliary next-next-token head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, models.H)
        self.head_a = nn.Linear(models.H, V, bias=False)
        self.head_b = nn.Linear(models.H, V)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        loss_a = F.cross_entropy(self.head_a(x).view(-1, V), labels.view(-1))
        loss_b = F.cross_entropy(self.head_b(x).float().view(-1, V), labels.roll(1, 1).view(-1))
        return loss_a + 0.5 * loss_b


def test_two_heads_two_rewrites_and_json():
    model = TwoHeads()
    tokens = torch.randint(0, V, (2, 9))
    report = tile_pass.explain(model, tokens, _inputs()[2])
    assert len(report.rewrites) == 2, str(report)
    assert {"F.linear", "F.linear(+bias)"} == {r.form.split(" -> ")[0] for r in report.rewrites}
    data = json.loads(report.to_json())
    assert len(data["rewrites"]) == 2 and data["graphs"] == 1
    assert all("test_inspection.py" in r["matmul_source"] for r in data["rewrites"])


def test_dump_dir_has_before_and_after_code(tmp_path):
    backend = tile_pass.backend("aot_eager", dump_dir=str(tmp_path))
    torch.compile(models.f_linear_view_float, backend=backend)(*_inputs())
    before = (tmp_path / "graph_0_before.py").read_text()
    after = (tmp_path / "graph_0_after.py").read_text()
    assert "torch._C._nn.linear" in before and "cross_entropy" in before
    assert "run_region" in after and "torch._C._nn.linear" not in after
    assert "# File:" in after and "models.py" in after  # the user's source line beside each node
    report = json.loads((tmp_path / "graph_0_report.json").read_text())
    assert len(report["rewrites"]) == 1


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_PASS_DUMP_DIR", str(tmp_path))
    torch.compile(models.f_linear_view_float, backend=tile_pass.backend("eager"))(*_inputs())
    assert (tmp_path / "graph_0_after.py").exists()


def test_structured_trace_artifacts():
    """tlparse reads trace_structured records: the pass emits before/after and its decisions."""
    from torch._logging._internal import trace_log

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect()
    trace_log.addHandler(handler)
    old_level = trace_log.level
    trace_log.setLevel(logging.DEBUG)
    try:
        torch.compile(models.f_linear_view_float, backend=tile_pass.backend("eager"))(*_inputs())
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(old_level)
    names = [getattr(r, "metadata", {}).get("artifact", {}).get("name") for r in records]
    assert {"tile_pass_graph_before", "tile_pass_graph_after", "tile_pass_decisions"} <= set(names)


def test_torch_logs_prints_decisions():
    code = (
        "import torch, tile_pass, torch.nn.functional as F\n"
        "def f(h, w, y):\n"
        "    return F.cross_entropy(F.linear(h, w), y)\n"
        "torch.compile(f, backend=tile_pass.backend('eager'))("
        "torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,)))\n"
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "+tile_pass"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "REWRITTEN F.linear -> cross_entropy" in proc.stderr
    assert "rewritten graph 0" in proc.stderr  # debug level: the graph itself


# ----------------------------------------------------------------------------- decorator


def test_decorator_on_function_bare_and_with_options():
    @tile_pass.tiled_loss(inner="aot_eager", tile_tokens=4)
    def loss_fn(h, w, y):
        return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1))

    @tile_pass.tiled_loss
    def bare(h, w, y):
        return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1))

    h, w, y = _inputs()
    ref = F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1))
    torch.testing.assert_close(loss_fn(h, w, y), ref)
    assert loss_fn.tile_pass_backend.report().rewrites[0].tile_tokens == 4
    assert callable(bare) and bare.tile_pass_backend.inner == "inductor"


def test_decorator_on_module_forward():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(models.H, V)

        @tile_pass.tiled_loss(inner="aot_eager", tile_tokens=4)
        def forward(self, h, y):
            return F.cross_entropy(self.proj(h).view(-1, V), y.view(-1))

    head = Head()
    h, _, y = _inputs()
    loss = head(h, y)
    loss.backward()
    ref_w = head.proj.weight.grad.clone()
    head.zero_grad()
    F.cross_entropy(head.proj(h).view(-1, V), y.view(-1)).backward()
    torch.testing.assert_close(ref_w, head.proj.weight.grad)


def test_decorator_raises_when_nothing_can_be_tiled():
    @tile_pass.tiled_loss(inner="eager")
    def uses_topk(h, w, y):
        logits = F.linear(h, w).view(-1, V)
        return F.cross_entropy(logits, y.view(-1)) + logits.topk(2, -1).values.mean() * 0

    with pytest.raises(tile_pass.TiledLossNotApplied, match=r"also consumed by `\.topk\(\)`"):
        uses_topk(*_inputs())

    @tile_pass.tiled_loss(inner="eager")
    def no_loss(h, w, y):
        return (h * 2).sum()

    with pytest.raises(tile_pass.TiledLossNotApplied, match="no F.linear/matmul followed by cross_entropy"):
        no_loss(*_inputs())


# ---------------------------------------------------------------------------- validation


@pytest.fixture
def wrong_weight_gradient():
    """Test-only fault injection: the seed bug of this field (weight gradient 1.375x off)."""

    def faulty_vjp(ctx, *grads):
        out = list(_loss_vjp(ctx, *grads))
        if out[1] is not None:
            out[1] = out[1] * 1.375
        return tuple(out)

    _row_region_loss.register_autograd(faulty_vjp, setup_context=_loss_setup_context)
    yield
    _row_region_loss.register_autograd(_loss_vjp, setup_context=_loss_setup_context)


def test_validate_passes_on_a_correct_rewrite():
    model = models.TinyLM()
    result = tile_pass.validate(model, torch.randint(0, V, (2, 9)), _inputs()[2])
    assert result.ok and len(result.rows) == 1 + len(list(model.parameters()))
    assert "lm_head.weight" in str(result)


def test_validate_catches_an_injected_wrong_gradient(wrong_weight_gradient):
    model = models.TinyLM()
    with pytest.raises(tile_pass.ValidationError, match=r"grad lm_head\.weight .* NO"):
        tile_pass.validate(model, torch.randint(0, V, (2, 9)), _inputs()[2])


def test_backend_validate_true(wrong_weight_gradient):
    h, w, y = _inputs()
    compiled = torch.compile(
        models.f_linear_view_float, backend=tile_pass.backend("aot_eager", validate=True)
    )
    with pytest.raises(tile_pass.ValidationError, match="grad of graph input"):
        compiled(h, w, y)


def test_backend_validate_true_passes_and_returns_the_result():
    h, w, y = _inputs()
    compiled = torch.compile(
        models.f_linear_view_float, backend=tile_pass.backend("aot_eager", validate=True)
    )
    out = compiled(h, w, y)
    torch.testing.assert_close(out, models.f_linear_view_float(h, w, y))
    out.backward()
    assert w.grad is not None


def test_backend_validate_says_when_it_could_not_use_float64():
    """A graph that cannot run in float64 (a float32 tensor made inside it) is checked against a
    same-dtype run, and the result says so instead of passing as a float64 check."""
    h, w, y = _inputs()

    def head(h, w, y):
        bias = torch.zeros(w.shape[0])  # float32 whatever the inputs: float64 F.linear rejects it
        return F.cross_entropy(F.linear(h, w, bias).view(-1, w.shape[0]), y.view(-1))

    backend = tile_pass.backend("aot_eager", validate=True)
    torch.compile(head, backend=backend)(h, w, y).backward()
    (graph,) = backend.report().graphs
    assert graph.rewrites and graph.validation.ok
    assert graph.validation.oracle.startswith("same-dtype eager (float64 eager failed: RuntimeError")
    assert str(graph.validation).startswith("oracle: same-dtype eager")
    clean = tile_pass.backend("aot_eager", validate=True)
    torch.compile(models.f_linear_view_float, backend=clean)(h, w, y)
    assert clean.report().graphs[0].validation.oracle == "float64 eager"


# ---------------------------------------------------------------------------------- CLI


def test_cli_with_args_spec(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch.nn.functional as F\n"
        "def head(h, w, y):\n"
        "    return F.cross_entropy(F.linear(h, w).float().view(-1, w.shape[0]), y.view(-1))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tile_pass", "explain", f"{script}:head",
         "--args", "float32[2,8,16] float32[50,16] int64[2,8]<50"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 region(s) rewritten" in proc.stdout and "train.py:3 (head)" in proc.stdout


def test_cli_with_factory_and_json():
    target = f"{Path(__file__).parent / 'models.py'}:cli_example"
    proc = subprocess.run(
        [sys.executable, "-m", "tile_pass", "explain", target, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["rewrites"]) == 1


def test_cli_explains_a_zero_argument_step(tmp_path):
    """A step that builds its own inputs and computes the loss is explained as it is."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "h = torch.randn(16, 8, requires_grad=True)\n"
        "w = torch.randn(40, 8, requires_grad=True)\n"
        "y = torch.randint(0, 40, (16,))\n"
        "def step():\n"
        "    loss = F.cross_entropy(F.linear(h, w), y)\n"
        "    loss.backward()\n"
        "    return loss\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tile_pass", "explain", f"{script}:step"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 region(s) rewritten" in proc.stdout and "train.py:6 (step)" in proc.stdout


def test_cli_bad_spec_says_what_is_expected():
    proc = subprocess.run(
        [sys.executable, "-m", "tile_pass", "explain", "math:sqrt", "--args", "floaty[2]"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "unknown dtype" in proc.stderr


# ------------------------------------------------ reasons everywhere: a head never gets a generic one


def _explain_head(fn, *args):
    report = tile_pass.explain(fn, *args)
    assert "no linear + cross_entropy candidate" not in str(report), str(report)
    assert all("no row-wise region of it was found" not in s.reason for s in report.skipped), str(report)
    return report


def _head_inputs(vocab=V, tokens=8):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, models.H, generator=g, requires_grad=True)
    w = torch.randn(vocab, models.H, generator=g, requires_grad=True)
    return h, w, torch.randint(0, vocab - 1, (tokens,), generator=g)


def test_a_loss_taking_the_logits_by_keyword_is_tiled():
    """``F.cross_entropy(input=logits, target=...)``: the keyword input is the head's sign too."""

    def loss(h, w, y):
        return F.cross_entropy(input=F.linear(h, w), target=y)

    report = _explain_head(loss, *_head_inputs())
    assert len(report.rewrites) == 1 and not report.skipped, str(report)


def test_a_vocabulary_slice_is_named_with_its_line():
    """Every reader on the way to the loss has a rule, but one declines: its own reason, not "no
    row-wise region of it was found"."""

    def loss(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits[:, :-1], y)

    report = _explain_head(loss, *_head_inputs())
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    reason = report.skipped[0].reason
    assert "`getitem` at test_inspection.py:" in reason and "other than token rows" in reason, reason


def test_rows_only_returned_are_named():
    """A head whose only reader gives [tokens, V] rows the graph returns: that reader is named."""

    def log_probs(h, w):
        return F.linear(h, w).log_softmax(-1)

    report = _explain_head(log_probs, *_head_inputs()[:2])
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    reason = report.skipped[0].reason
    assert "`.log_softmax()` at test_inspection.py:" in reason and "returns whole" in reason, reason


def test_a_rewrite_that_declines_reports_the_loss_once():
    """A reason found while rewriting (an operand computed after the first reader, with no rule to
    move it) holds the loss: one skip at the loss's line, no second generic one."""

    def loss(h, w, y):
        logits = F.linear(h, w)
        lse = torch.sort(logits.logsumexp(-1)).values  # read outside the region, early
        labels = y.roll(1, 0)  # an op the splice does not move (no row-wise rule, not known pure)
        return F.cross_entropy(logits, labels), lse

    report = _explain_head(loss, *_head_inputs())
    assert not report.rewrites and len(report.skipped) == 1, str(report)
    skip = report.skipped[0]
    assert "F.cross_entropy(logits, labels)" in skip.loss_source, str(report)
    assert "`.roll()` at test_inspection.py:" in skip.reason, skip.reason
    assert "cannot be moved" in skip.reason, skip.reason


def _masked_ce(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _ce_and_logits(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits, y), logits


def _log_probs(h, w, y):
    return F.linear(h, w).log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (
            _masked_ce,
            "on CPU, tokens where every output is zero (an ignored label or a zero mask) run no GEMM",
        ),
        (_ce_and_logits, "none: the graph returns the logits of every token"),
        (_log_probs, "none: squeeze is read outside the loss and is not zero at an ignored label"),
    ],
    ids=["ignored-labels", "returned-logits", "per-token-output"],
)
def test_report_says_which_tokens_the_tiles_skip_or_why_none(fn, expected):
    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(V, 8, requires_grad=True)
    y = torch.randint(0, V, (12,))
    y[::3] = -100
    report = tile_pass.backend("eager").explain(fn, h, w, y)
    (rewrite,) = report.rewrites
    assert rewrite.token_skipping.startswith(expected), rewrite.token_skipping
    assert f"token skipping: {rewrite.token_skipping}" in str(report)


@pytest.mark.parametrize(
    ("tokens", "dtype", "autocast", "tile_tokens"),
    [
        (1000, torch.float32, False, None),  # automatic tiles, the float32 sum
        (1000, torch.float32, False, 96),  # a fixed tile, a short last one
        (200, torch.bfloat16, False, None),  # one tile: the direct schedule
        (3000, torch.bfloat16, False, None),  # the split sum
        (3000, torch.float32, True, None),  # autocast: the plan of the bfloat16 weight
    ],
    ids=["fp32-auto", "fp32-fixed", "bf16-direct", "bf16-split", "autocast-bf16"],
)
def test_the_report_gives_the_plan_the_tiles_ran(tokens, dtype, autocast, tile_tokens):
    """``explain`` plans from the sizes and the loop from the batch, with one planner: for a
    batch whose every token counts they must agree on the tile, the tiles and the sum."""
    from tile_pass._rewrite_record import _weight_grad_sum
    from tile_pass.plan import _plan

    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(2000, 32, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, 2000, (tokens,), generator=g)
    backend = tile_pass.backend("aot_eager", tile_tokens=tile_tokens)
    with _plan.recorded() as plans, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y), backend=backend)(
            h, w, y
        )
    loss.backward()
    (rewrite,) = backend.report().rewrites
    (ran,) = plans  # one loop: the loss's gradient is formed in forward
    assert ran.rows == tokens
    assert (rewrite.tile_tokens, rewrite.num_tiles) == (ran.tile, ran.num_tiles)
    assert rewrite.weight_grad_sum == _weight_grad_sum(ran.schedule, torch.bfloat16 if autocast else dtype)


def test_a_dynamic_size_is_reported_with_its_value_at_compile():
    backend = tile_pass.backend("aot_eager")
    step = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), backend=backend, dynamic=True)
    h, w = torch.randn(300, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    step(h, w, torch.randint(0, 50, (300,))).backward()
    (rewrite,) = backend.report().rewrites
    assert rewrite.num_tokens.endswith(" (300 at compile)"), rewrite.num_tokens
    assert "at compile) tiles" in str(rewrite), str(rewrite)


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch 2.11's Dynamo breaks the graph before the loss (it cannot prove the two "
    "data-dependent sizes equal), so no graph holds a head and its loss (2.12 not tried)",
)
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_an_unbacked_size_is_reported_without_a_value():
    """A data-dependent token count had no value at compile: the report gives its expression alone."""
    backend = tile_pass.backend("aot_eager")
    step = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h[y >= 0], w), y[y >= 0]), backend=backend)
    h, w = torch.randn(300, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    y = torch.randint(0, 50, (300,))
    y[::3] = -100
    step(h, w, y).backward()
    (rewrite,) = backend.report().rewrites
    assert rewrite.num_tokens.startswith("u") and "at compile" not in rewrite.num_tokens, rewrite.num_tokens


def test_a_peak_that_grows_is_said_to_grow():
    """A tiny batch's tiles can hold more than its logits: the report says "higher", not "-x lower"."""
    from tile_pass.report import _lower

    assert _lower(-192000) == "187.5 KiB higher" and _lower(192000) == "187.5 KiB lower"
