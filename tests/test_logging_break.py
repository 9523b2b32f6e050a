"""A log call between the LM head and its loss: ``tile_pass.compile`` traces past transformers'
once-only advisories (for the functions it compiles only), every other log call still breaks the
graph and is still printed, and the report names the exact setting where the graph broke."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads

import tile_pass
from tile_pass import _logging_calls

transformers = pytest.importorskip("transformers")  # installs Logger.warning_once / info_once

once_logger = transformers.utils.logging.get_logger("tile_pass_tests.once")
plain_logger = logging.getLogger("tile_pass_tests.plain")
N, H, V = 24, 16, 40


def once_between(hidden, weight, labels):
    logits = hidden @ weight.t()
    once_logger.warning_once("between the head and the loss")
    return F.cross_entropy(logits.float(), labels)


def info_once_between(hidden, weight, labels):
    logits = hidden @ weight.t()
    once_logger.info_once("between the head and the loss, at INFO")
    return F.cross_entropy(logits.float(), labels)


def plain_between(hidden, weight, labels):
    logits = hidden @ weight.t()
    plain_logger.warning("a plain warning between the head and the loss")
    return F.cross_entropy(logits.float(), labels)


def inputs(device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:5] = -100
    return hidden.to(device), weight.to(device), labels.to(device)


def _logging_breaks() -> int:
    return sum(n for reason, n in torch._dynamo.utils.counters["graph_break"].items() if "logging" in reason)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [once_between, info_once_between], ids=["warning_once", "info_once"])
def test_tile_pass_compile_keeps_head_and_loss_in_one_graph_across_a_once_only_log_call(fn, device):
    hidden, weight, labels = inputs(device)
    before = set(torch._dynamo.config.ignore_logging_functions)
    breaks = _logging_breaks()
    compiled = tile_pass.compile(fn, "aot_eager", tile_tokens=8)
    x, w = leaves(hidden, weight)
    loss, grads = value_and_grads(compiled, [x, w, labels])
    x64, w64 = leaves(hidden, weight, dtype=torch.float64)
    ref, ref_grads = value_and_grads(fn, [x64, w64, labels])
    assert_close_to_oracle(loss, ref, torch.float32, "loss")
    for got, want, name in zip(grads[:2], ref_grads[:2], ("hidden", "weight"), strict=True):
        assert_close_to_oracle(got, want, torch.float32, f"grad {name}")
    report = compiled.tile_pass_backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    assert report.rewrites[0].num_tiles == 3, str(report)  # 24 tokens in tiles of 8: really tiled
    assert _logging_breaks() == breaks  # Dynamo did not stop at the call
    assert set(torch._dynamo.config.ignore_logging_functions) == before  # nothing left set


def test_the_setting_holds_only_while_a_function_tile_pass_compiled_runs():
    seen = []

    def inner(gm, example_inputs):  # called while Dynamo traces, inside the compiled call
        seen.append(logging.Logger.warning_once in torch._dynamo.config.ignore_logging_functions)
        return gm.forward

    hidden, weight, labels = inputs("cpu")
    tile_pass.compile(once_between, inner, compile_tiles=False)(hidden, weight, labels)
    assert seen == [True]
    assert logging.Logger.warning_once not in torch._dynamo.config.ignore_logging_functions
    # the same function compiled otherwise still stops at the call: the setting is not the process's
    torch._dynamo.reset()
    breaks = _logging_breaks()
    plain = torch.compile(once_between, backend="aot_eager")
    plain(hidden, weight, labels)
    assert _logging_breaks() > breaks


def test_an_ordinary_log_call_still_breaks_the_graph_and_is_still_printed(caplog):
    hidden, weight, labels = inputs("cpu")
    compiled = tile_pass.compile(plain_between, "aot_eager", tile_tokens=8)
    with caplog.at_level(logging.WARNING, logger=plain_logger.name):
        loss = compiled(hidden, weight, labels)
    assert any("a plain warning" in r.getMessage() for r in caplog.records)  # the line is kept
    torch.testing.assert_close(loss, plain_between(hidden, weight, labels))
    report = compiled.tile_pass_backend.report()
    assert not report.rewrites
    skips = [s for s in report.skipped if "graph break separates the LM head from the loss" in s.reason]
    assert skips, str(report)
    for skip in skips:  # each names the call and the exact setting that would trace past it
        assert "`tile_pass_tests.plain` logger's `.warning(...)`" in skip.reason, skip.reason
        assert "add logging.Logger.warning to torch._dynamo.config.ignore_logging_functions" in skip.reason


def once_between_after_a_break(hidden, weight, labels):
    hidden = hidden * 2
    torch._dynamo.graph_break()  # the head is traced in a resumed frame (CTRL's is)
    return once_between(hidden, weight, labels)


@pytest.mark.parametrize("fn", [once_between, once_between_after_a_break], ids=["first", "resumed"])
def test_with_torch_compile_the_report_names_the_entry_point_and_the_setting(fn):
    hidden, weight, labels = inputs("cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=8)
    torch.compile(fn, backend=backend)(hidden, weight, labels)
    report = backend.report()
    assert not report.rewrites
    skips = [s for s in report.skipped if "graph break separates the LM head from the loss" in s.reason]
    assert skips, str(report)
    for skip in skips:
        assert "tile_pass.compile(model)" in skip.reason, skip.reason
        assert "torch._dynamo.config.ignore_logging_functions.add(logging.Logger.warning_once)" in skip.reason
    # ... and that exact setting, for the process, is enough
    torch._dynamo.reset()
    with torch._dynamo.config.patch(ignore_logging_functions={logging.Logger.warning_once}):
        backend = tile_pass.backend("aot_eager", tile_tokens=8)
        torch.compile(fn, backend=backend)(hidden, weight, labels)
    assert len(backend.report().rewrites) == 1, str(backend.report())


def test_hint_for_each_kind_of_logging_break():
    once = (
        "logging.Logger method not supported for non-export cases\n  Developer debug context: method: "
        "<Logger transformers.modeling_utils (WARNING)>.warning_once, args: [ConstantVariable(str: "
        "'`loss_type=None` was set in the config but it is unrecognized.')], kwargs: {}"
    )
    hint = _logging_calls.logging_break_hint(once)
    assert "`transformers.modeling_utils` logger's `.warning_once(...)`" in hint
    assert "tile_pass.compile(model)" in hint and "compile_for_training(model)" in hint
    assert 'model.loss_type = "ForCausalLM"' in hint  # that advisory's own fix
    plain = once.replace(".warning_once", ".info").replace("loss_type=None", "something else")
    hint = _logging_calls.logging_break_hint(plain)
    assert "add logging.Logger.info to torch._dynamo.config.ignore_logging_functions" in hint
    assert "tile_pass.compile" not in hint and "loss_type" not in hint


def test_the_setting_is_restored_when_the_compiled_call_raises():
    def raises_after_the_log_call(hidden, weight, labels):
        logits = hidden @ weight.t()
        once_logger.warning_once("before an error")
        if labels.shape[0] != logits.shape[0]:
            raise ValueError("labels and logits disagree")
        return F.cross_entropy(logits, labels)

    hidden, weight, labels = inputs("cpu")
    compiled = tile_pass.compile(raises_after_the_log_call, "aot_eager")
    with pytest.raises(ValueError, match="disagree"):
        compiled(hidden, weight, labels[:-1])
    assert logging.Logger.warning_once not in torch._dynamo.config.ignore_logging_functions


def test_fullgraph_compiles_across_a_once_only_log_call():
    hidden, weight, labels = inputs("cpu")
    with pytest.raises(torch._dynamo.exc.Unsupported):  # torch.compile alone: the call is a break
        torch.compile(once_between, backend=tile_pass.backend("aot_eager"), fullgraph=True)(
            hidden, weight, labels
        )
    torch._dynamo.reset()
    compiled = tile_pass.compile(once_between, "aot_eager", tile_tokens=8, fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight, labels), once_between(hidden, weight, labels))
    assert len(compiled.tile_pass_backend.report().rewrites) == 1
