"""The RL and preference frameworks' training steps, through their own functions, under the pass.

Each step of ``tests/rl_steps.py`` (verl's actor on its padded and remove-padding paths with
every registered policy loss, ``agg_loss`` mode and ``kl_penalty`` type; OpenRLHF's actor and
DPO trainer; torchtune's PPO, DPO and GRPO recipes; NeMo-RL's clipped policy gradient) is
compiled unchanged with ``tile_pass.backend("aot_eager")`` at the default tile and a small
one, and compared with float64 eager. ``EXPECTED`` says what the report must say for each:
``"tiled"`` (every head rewritten, nothing skipped) or ``"skipped"`` (a head, or a graph that
receives its logits, left whole; every head listed, the skipped ones with their reason and
line); ``"unaccounted"`` marks a step whose head the report does not mention yet, a known gap
the accounting test asserts against (``xfail(strict=True)``, so fixing the
pass fails the run until the entry is flipped).

Frameworks that are not installed skip (``pip install -e '.[rl]'``, with ``--no-deps``: see
``pyproject.toml``). The default run covers one step per composition; the full matrix of
policy losses, aggregation modes and KL types is ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import operator

import pytest
import rl_steps as S
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle

import tile_pass

SMALL_TILE = 5  # 4 to 7 tiles at these sizes, the last one short

#: what the report says of each step now: "tiled", "skipped" or "unaccounted" (a one-line flip)
EXPECTED = {
    **{f"verl/padded-{mode}": "tiled" for mode in (
        "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
        "cispo", "bypass_mode")},
    **{f"verl/padded-agg-{agg}": "tiled" for agg in (
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")},
    **{f"verl/padded-kl-{kl}": "tiled" for kl in ("k1", "abs", "k2", "k3", "k1+", "k3+")},
    "verl/padded-no-entropy": "tiled",
    "verl/rmpad": "tiled",
    # `logits_rmpad.div_(T)` on `[1, nnz, V].squeeze(0)`, the log-probs of every row beside the
    # chunked entropy's slices of the squeezed rows: each chunk a selection of the tiles' rows
    "verl/rmpad-chunked-entropy": "tiled",
    "verl/rmpad-kl-k3": "tiled",
    "verl/rmpad-engine-temperature": "tiled",
    # log_probs_from_logits imports flash-attn inside a try block: a graph break between the head
    # (its graph returns the logits whole) and the log-softmax (the logits an input), both reported
    "openrlhf/ppo-k3-entropy": "skipped",
    "openrlhf/ppo-dual-clip-k1": "skipped",
    "openrlhf/gspo-k2": "skipped",
    "openrlhf/ppo-no-entropy": "skipped",
    "openrlhf/dpo": "skipped",
    "openrlhf/ppo-temperature-in-helper": "skipped",
    "torchtune/ppo": "tiled",
    "torchtune/dpo": "tiled",
    "torchtune/dpo-reward-accuracy": "tiled",
    # the reference head is computed after the policy's logits are first read, under no_grad: its
    # pure ops move before the policy's region (its labels' masked write replayed as masked_fill)
    "torchtune/dpo-reference-forward": "tiled",
    "torchtune/grpo": "tiled",
    "torchtune/grpo-simple": "tiled",
    "torchtune/grpo-completion": "tiled",
    # batched_logits_to_logprobs(chunk_size=1): chunks of sequences of the truncated logits, each a
    # slice of a slice, one selection of the tiles' rows
    "torchtune/grpo-batched-logprobs": "tiled",
    # ClippedPGLossFn reads a metric with .item() before the logits: a graph break between head
    # and log-softmax (reported in both graphs); without the metrics it is tiled
    "nemo-rl/clipped-pg": "skipped",
    "nemo-rl/clipped-pg-no-metrics": "tiled",
    "nemo-rl/clipped-pg-t1": "skipped",
    # the sampler's top-k filter as a custom autograd.Function on the logits: named with its line
    # and a fix (test_a_top_k_filter_is_named_with_its_line_and_a_fix)
    "nemo-rl/clipped-pg-top-k": "skipped",
}  # fmt: skip

#: steps whose compiled gradients are off under plain ``backend="aot_eager"`` too (PyTorch, not
#: the pass: ``log_probs_from_logits(logits[:, :-1], ..., temperature)`` divides a view of the
#: logits in place, then a graph break, then the entropy reads the same logits): there the pass
#: must match the inner backend it wraps
INNER_BACKEND_WRONG = {"openrlhf/ppo-temperature-in-helper"}

#: the default run: one step per composition (the rest under ``-m slow``)
FAST = {
    "verl/padded-vanilla", "verl/rmpad", "verl/rmpad-chunked-entropy", "openrlhf/ppo-k3-entropy",
    "openrlhf/dpo", "openrlhf/ppo-temperature-in-helper", "torchtune/ppo", "torchtune/dpo-reference-forward",
    "torchtune/grpo-batched-logprobs",
    "nemo-rl/clipped-pg",
}  # fmt: skip


def _key(step: S.Step) -> str:
    return f"{step.framework}/{step.name}"


def _params():
    out = []
    for step in S.all_steps():
        marks = [] if _key(step) in FAST else [pytest.mark.slow]
        out.append(pytest.param(step, id=_key(step), marks=marks))
    return out


STEPS = _params()


def _run(fn, data, device, dtype, seed=0):
    """The loss (the first output) and the gradients of ``h`` and ``w``, the RNG seeded first:
    verl's clip_cov draws which tokens to clip, and both runs must draw the same."""
    h, w, d = data(device)
    if dtype == torch.float64:
        h, w, d = S.float64((h, w, d))
    h.requires_grad_()
    w.requires_grad_()
    torch.manual_seed(seed)
    out = fn(h, w, d)
    loss = out[0] if isinstance(out, tuple) else out
    return loss.detach(), torch.autograd.grad(loss, [h, w])


def _eager(step, device, dtype=torch.float64):
    """The oracle: every ``torch.compile`` inside a framework (OpenRLHF's ``compute_entropy``)
    runs eagerly too."""
    with torch.compiler.set_stance("force_eager"):
        return _run(step.fn, step.data, device, dtype)


def _check_close(actual, oracle, name):
    (loss, grads), (oracle_loss, oracle_grads) = actual, oracle
    assert loss.dtype == torch.float32
    assert_close_to_oracle(loss, oracle_loss, torch.float32, f"{name} loss")
    for grad, ref, what in zip(grads, oracle_grads, ("hidden", "weight"), strict=True):
        assert_close_to_oracle(grad, ref, torch.float32, f"{name} d{what}")


_HEAD_OPS = {operator.matmul, torch.matmul, F.linear, torch._C._nn.linear, "matmul", "__matmul__"}


def _heads_in_graphs(step: S.Step, device) -> int:
    """Projections to the vocabulary in the graphs Dynamo makes of the step, counted from the
    graphs themselves (a matmul or linear whose output's last dimension is V)."""
    heads = 0

    def count(gm, example_inputs):
        nonlocal heads
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if (
                node.op in ("call_function", "call_method")
                and node.target in _HEAD_OPS
                and (isinstance(value, torch.Tensor) and value.shape[-1] == S.V)
            ):
                heads += 1
        return gm.forward

    torch._dynamo.reset()
    _run(torch.compile(step.fn, backend=count), step.data, device, torch.float32)
    torch._dynamo.reset()
    return heads


def _assert_accounted(report, heads: int, name: str):
    """Every head is in the report: rewritten, or skipped with a reason and a source line."""
    assert len(report.rewrites) + len(report.skipped) >= heads, f"{name}: a head is unaccounted for\n{report}"
    for skip in report.skipped:
        assert skip.reason, f"{name}: a skip without a reason\n{report}"
        assert ".py:" in skip.loss_source, f"{name}: a skip without a source line\n{report}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [None, SMALL_TILE], ids=["default-tile", "small-tile"])
@pytest.mark.parametrize("step", STEPS)
def test_step_is_exact_and_reported(step, tile, device):
    name = _key(step)
    settings = {} if tile is None else {"tile_tokens": tile}
    backend = tile_pass.backend("aot_eager", **settings)
    torch._dynamo.reset()
    compiled = _run(torch.compile(step.fn, backend=backend), step.data, device, torch.float32)
    report = backend.report()
    if name in INNER_BACKEND_WRONG:
        torch._dynamo.reset()
        inner = _run(torch.compile(step.fn, backend="aot_eager"), step.data, device, torch.float32)
        _check_close(compiled, inner, f"{name} against plain aot_eager")
        eager = _eager(step, device)
        with pytest.raises(AssertionError):  # still wrong upstream: when fixed, move the step out
            _check_close(inner, eager, name)
    else:
        _check_close(compiled, _eager(step, device), name)
    expected = EXPECTED[name]
    if expected == "tiled":
        assert len(report.rewrites) == step.heads and not report.skipped, f"{name}\n{report}"
    elif expected == "skipped":  # a head, or a graph holding its logits, left whole: named with why
        assert report.skipped, f"{name}\n{report}"
        _assert_accounted(report, step.heads, name)
    else:  # "unaccounted": the report is silent on the head (the next test asserts against that)
        assert not report.rewrites and not report.skipped, (
            f"{name}: flip EXPECTED to 'tiled'/'skipped'\n{report}"
        )


def _accounting_params():
    out = []
    for param in STEPS:
        step = param.values[0]
        marks = list(param.marks)
        if EXPECTED[_key(step)] == "unaccounted":
            marks.append(pytest.mark.xfail(strict=True, reason="the report says nothing of this step's head"))
        out.append(pytest.param(step, id=param.id, marks=marks))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", _accounting_params())
def test_every_head_is_accounted_for(step, device):
    """The heads Dynamo's graphs hold (counted from the graphs) are each rewritten or skipped
    with a reason and a line."""
    heads = _heads_in_graphs(step, device)
    assert heads == step.heads, f"{_key(step)}: the fixture says {step.heads} heads, the graphs hold {heads}"
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    torch._dynamo.reset()
    _run(torch.compile(step.fn, backend=backend), step.data, device, torch.float32)
    _assert_accounted(backend.report(), heads, _key(step))


def test_every_step_has_an_expectation():
    """A step added to the fixtures without an entry would otherwise fail with a KeyError."""
    assert {_key(p.values[0]) for p in STEPS} <= set(EXPECTED)


def test_the_frameworks_own_functions_are_called():
    """Where a framework installs, its steps call its functions, not copies (skips otherwise)."""
    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("openrlhf") is None:
        pytest.skip("verl or openrlhf is not installed")
    v = S.verl()
    assert v.F.logprobs_from_logits.__module__ == "verl.utils.torch_functional"
    assert set(v.core_algos.POLICY_LOSS_REGISTRY) >= {"vanilla", "gspo", "clip_cov", "kl_cov", "gpg"}
    registered = {n.removeprefix("verl/padded-") for n in EXPECTED if n.startswith("verl/padded-")}
    assert set(v.core_algos.POLICY_LOSS_REGISTRY) <= registered, "a policy loss verl registers is not tested"
    o = S.openrlhf()
    assert o.utils.log_probs_from_logits.__module__ == "openrlhf.models.utils"


@pytest.mark.parametrize("device", DEVICES)
def test_nemo_rl_metrics_tile_with_the_reported_fix(device):
    """NeMo-RL's loss reads a metric with ``.item()`` before the logits; the skip's fix (Dynamo's
    ``capture_scalar_outputs``) keeps head and loss in one graph: tiled, and exact."""
    step = next(s for s in S.all_steps() if _key(s) == "nemo-rl/clipped-pg")
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = _run(torch.compile(step.fn, backend=backend), step.data, device, torch.float32)
    report = backend.report()
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    _check_close(compiled, _eager(step, device), "nemo-rl/clipped-pg, scalars captured")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["openrlhf/ppo-k3-entropy", "openrlhf/gspo-k2", "openrlhf/dpo"])
def test_openrlhf_steps_tile_with_the_integration(name, device):
    """With ``hand_log_probs_to_tile_pass()`` OpenRLHF's steps keep head, entropy and
    log-probabilities in one graph: rewritten, nothing skipped, and equal to float64 eager of
    the same step through OpenRLHF's own helper (the oracle runs before the swap)."""
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip("openrlhf is not installed")
    from tile_pass.integrations import openrlhf as integration

    step = next(s for s in S.all_steps() if _key(s) == name)
    oracle = _eager(step, device)
    o = S.openrlhf()
    own = o.utils.log_probs_from_logits
    try:
        assert integration.hand_log_probs_to_tile_pass() == ["openrlhf.models.utils"]
        assert o.utils.log_probs_from_logits is integration.log_probs_from_logits
        backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
        torch._dynamo.reset()
        compiled = _run(torch.compile(step.fn, backend=backend), step.data, device, torch.float32)
    finally:
        integration.restore_log_probs()
    assert o.utils.log_probs_from_logits is own
    report = backend.report()
    assert len(report.rewrites) == step.heads and not report.skipped, f"{name}\n{report}"
    _check_close(compiled, oracle, f"{name} with the integration")


@pytest.mark.parametrize("device", DEVICES)
def test_a_top_k_filter_is_named_with_its_line_and_a_fix(device):
    """A top-k filter the pass cannot tile (a custom autograd.Function, whose backward is its
    author's; or ``torch.topk`` over the row) leaves the logits whole, exact, and the skip names the
    filter's line and what to do."""
    step = next(s for s in S.all_steps() if _key(s) == "nemo-rl/clipped-pg-top-k")
    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    torch._dynamo.reset()
    compiled = _run(torch.compile(step.fn, backend=backend), step.data, device, torch.float32)
    _check_close(compiled, _eager(step, device), "nemo-rl/clipped-pg-top-k")
    (skip,) = backend.report().skipped
    assert "_TopKFilter.apply(logits, top_k)" in skip.reason and "rl_steps.py:" in skip.reason
    assert "custom autograd.Function" in skip.reason and "fix:" in skip.reason

    def ops_filter(h, w, d):
        logits = (h @ w.t()) / S.TEMPERATURE
        kth = torch.topk(logits, S.V // 2, dim=-1).values[..., -1:]
        lp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
        return -lp.gather(-1, d["input_ids"].unsqueeze(-1)).squeeze(-1).mean()

    backend = tile_pass.backend("aot_eager", tile_tokens=SMALL_TILE)
    h, w, d = S.batch(device)
    torch.compile(ops_filter, backend=backend)(h, w, d)
    (skip,) = backend.report().skipped
    assert "torch.topk(logits" in skip.reason and "top-k / top-p filter" in skip.reason
    assert "fix:" in skip.reason
