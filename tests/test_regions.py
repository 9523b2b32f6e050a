"""Row-wise regions: every row-by-row use of the logits tiled, each exact against float64 eager.

Each form is the user's own loss code; the pass finds the projection and every node that
reads its logits row by row, replays them per tile, and derives the gradient. The checks
cover a fully masked tile, uneven valid counts per tile and more tiles than valid tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, assert_no_worse_than_eager
from models import H, V

import tile_pass

B, T = 3, 11
TILE = 4  # 33 tokens: 9 tiles, the first three fully masked in the "uneven" labels


def ce_z_loss(h, w, y, ids, mask, adv, teacher, bias):  # PaLM / OLMo / Chameleon
    logits = (h @ w.t()).float()
    ce = F.cross_entropy(logits.view(-1, V), y.view(-1))
    return ce + 1e-4 * logits.logsumexp(-1).pow(2).mean()


def ce_accuracy(h, w, y, ids, mask, adv, teacher, bias):
    logits = F.linear(h, w)
    valid = y != -100
    accuracy = ((logits.argmax(-1) == y) & valid).sum() / valid.sum()
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), accuracy


def entropy_bonus(h, w, y, ids, mask, adv, teacher, bias):
    logits = F.linear(h, w)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) - 0.01 * (entropy * mask).sum() / mask.sum()


def grpo_log_softmax_gather(h, w, y, ids, mask, adv, teacher, bias):
    logits = F.linear(h, w) / 0.7  # sampling temperature
    logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    per_sequence = (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -(adv * per_sequence).mean()


def selective_log_softmax(h, w, y, ids, mask, adv, teacher, bias):  # TRL's form
    logits = F.linear(h, w)
    logp = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return -((logp * mask).sum(-1) * adv).sum() / 7.0  # / num_items_in_batch


def dpo_sigmoid(h, w, y, ids, mask, adv, teacher, bias):  # nonlinear in the per-sequence sums
    logits = F.linear(h, w)
    logp = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    sums = (logp * mask).sum(-1)
    return -F.logsigmoid(0.1 * (sums[0] - sums[1] + sums[2]))


def kl_to_teacher(h, w, y, ids, mask, adv, teacher, bias):  # distillation
    student = F.log_softmax(F.linear(h, w) / 2.0, dim=-1)
    return (
        F.kl_div(student.view(-1, V), F.softmax(teacher / 2.0, -1).view(-1, V), reduction="batchmean") * 4.0
    )


def kl_written_out(h, w, y, ids, mask, adv, teacher, bias):
    teacher_logp = teacher.log_softmax(-1)
    kl = (teacher_logp.exp() * (teacher_logp - F.linear(h, w).log_softmax(-1))).sum(-1)
    return (kl * mask).sum() / mask.sum()


def bias_in_place_returned(h, w, y, ids, mask, adv, teacher, bias):
    logits = F.linear(h, w)
    logits += bias
    loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
    return loss + 1e-4 * logits.float().logsumexp(-1).pow(2).mean(), logits.float()  # accelerate's upcast


def flat_tokens(h, w, y, ids, mask, adv, teacher, bias):  # [N, V] logits; the lse is returned too
    logits = F.linear(h.reshape(-1, H), w)
    lse = logits.logsumexp(-1)
    return F.cross_entropy(logits, y.reshape(-1), reduction="sum") / 5.0 + 1e-3 * lse.pow(2).sum(), lse


def per_token_log_probs(h, w, y, ids, mask, adv, teacher, bias):  # RL: returned to the caller
    return F.linear(h, w).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def scaled_by_accuracy(h, w, y, ids, mask, adv, teacher, bias):
    # the log-probs' sum times a per-token value computed from the logits: the token weights
    # (derived before the tiles) cannot depend on it, so the op's loss is the sum alone and the
    # graph multiplies it (a silent zero gradient once)
    logits = F.linear(h, w)
    logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    correct = (logits.argmax(-1) == ids).to(logits.dtype) + mask
    return (logp.sum() * correct).sum()


FORMS = [ce_z_loss, ce_accuracy, entropy_bonus, grpo_log_softmax_gather, selective_log_softmax, dpo_sigmoid,
         kl_to_teacher, kl_written_out, bias_in_place_returned, flat_tokens, per_token_log_probs,
         scaled_by_accuracy]  # fmt: skip
#: the forms whose differentiable outputs end in one scalar through linear token reductions
# DPO's logsigmoid is not linear, but the margin it is taken of is: the op forms the margin's
# gradient in forward and the logsigmoid scales it, by the chain rule (slices of the per-sequence
# sums, sums[0] - sums[1] + sums[2], are linear steps). flat_tokens also returns its per-token
# log-sum-exps: the loss is formed in forward all the same, the returned values' gradient in backward
SCALAR_LOSS = {ce_z_loss, ce_accuracy, entropy_bonus, grpo_log_softmax_gather, selective_log_softmax,
               dpo_sigmoid, kl_to_teacher, kl_written_out, bias_in_place_returned,
               scaled_by_accuracy, flat_tokens}  # fmt: skip


def _labels(kind: str, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, V, (B, T), generator=g)
    if kind == "uneven":  # a fully masked first sequence (three whole tiles), then 9 and 4 labels
        y[0] = -100
        y[1, 9:] = -100
        y[2, :7] = -100
    elif kind == "sparse":  # 3 labelled tokens, 9 tiles
        y[:] = -100
        y[0, 5], y[1, 0], y[2, 10] = 1, 2, 3
    return y.to(device)


def _inputs(device, labels="uneven", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float32)
    mask[0, :6] = 0
    adv = torch.randn(B, generator=g)
    teacher = torch.randn(B, T, V, generator=g)
    bias = torch.randn(V, generator=g)
    h, w, ids, mask, adv, teacher, bias = (t.to(device) for t in (h, w, ids, mask, adv, teacher, bias))
    return (h.to(dtype), w.to(dtype), _labels(labels, device), ids, mask.to(dtype), adv.to(dtype),
            teacher.to(dtype), bias.to(dtype))  # fmt: skip


def _trainable(args):
    return (args[0].detach().requires_grad_(), args[1].detach().requires_grad_(), *args[2:])


def _run(fn, args, seed=1):
    """Outputs, and the gradients of hidden and weight for a random tangent on every output."""
    h, w = (args[0].detach().requires_grad_(), args[1].detach().requires_grad_())
    outs = fn(h, w, *args[2:])
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    total = 0
    for out in outs:
        if out.requires_grad:
            tangent = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
            total = total + (out * tangent).sum()
    grads = torch.autograd.grad(total, (h, w))
    return [o.detach() for o in outs], grads


def _oracle(fn, args):
    return _run(fn, [a.double() if a.is_floating_point() else a for a in args])


@pytest.mark.parametrize("labels", ["uneven", "sparse"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FORMS, ids=[f.__name__ for f in FORMS])
def test_form_is_rewritten_and_exact(fn, device, labels):
    args = _inputs(device, labels)
    report = tile_pass.explain(fn, *_trainable(args))
    assert len(report.rewrites) == 1 and not report.skipped, str(report)
    scalar = "one scalar loss" in report.rewrites[0].reduction
    assert scalar == (fn in SCALAR_LOSS), str(report)
    torch._dynamo.reset()
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    outs, grads = _run(torch.compile(fn, backend=backend), args)
    assert len(backend.report().rewrites) == 1
    ref_outs, ref_grads = _oracle(fn, args)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.dtype == (ref.dtype if not ref.is_floating_point() else torch.float32)
        assert out.shape == ref.shape
        assert_close_to_oracle(out, ref, torch.float32, f"{fn.__name__} output")
    for grad, ref, name in zip(grads, ref_grads, ("hidden", "weight"), strict=True):
        assert_close_to_oracle(grad, ref, torch.float32, f"{fn.__name__} d{name}")


def test_form_descriptions_name_outputs_and_ops():
    report = tile_pass.explain(ce_z_loss, *_trainable(_inputs("cpu")))
    form = report.rewrites[0].form
    expected = "hidden @ W.T -> .float() -> .reshape() -> cross_entropy(ignore_index=-100) -> .logsumexp()"
    expected += " -> .pow(2)"
    assert expected in form, form
    assert "token mean_valid, differentiable" in form and "per token, differentiable" in form
    assert "ce_z_loss" in report.rewrites[0].loss_source
    per_token = next(fn for fn in FORMS if fn not in SCALAR_LOSS)
    report = tile_pass.explain(per_token, *_trainable(_inputs("cpu")))
    assert "re-derived in backward" in report.rewrites[0].reduction


def test_all_ignored_batch_gives_what_eager_gives():
    args = _inputs("cpu")
    args = (args[0], args[1], torch.full_like(args[2], -100), *args[3:])
    compiled = torch.compile(ce_z_loss, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    (out,), grads = _run(compiled, args)
    (ref,), ref_grads = _oracle(ce_z_loss, args)
    assert torch.isnan(out) and torch.isnan(ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close_to_oracle(grad, ref_grad, torch.float32, "grad")


@pytest.mark.parametrize(
    ("fn", "position", "error", "message"),
    [(ce_z_loss, 2, IndexError, "Target 1000 is out of bounds."),
     (grpo_log_softmax_gather, 3, RuntimeError, "index 1000 is out of bounds for dimension 2 with size 29")],
    ids=["label", "gathered_id"],
)  # fmt: skip
def test_out_of_range_index_raises_as_eager(fn, position, error, message):
    args = list(_inputs("cpu"))
    bad = args[position].clone()
    bad[1, 3] = 1000
    args[position] = bad
    with pytest.raises(error, match=message):
        fn(*args)
    compiled = torch.compile(fn, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    with pytest.raises(error, match=message):
        compiled(*args)


def test_no_grad_and_double_backward():
    args = _inputs("cpu")
    compiled = torch.compile(entropy_bonus, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), entropy_bonus(*args), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    h = args[0].detach().requires_grad_()
    loss = torch.compile(dpo_sigmoid, backend=tile_pass.backend("eager", tile_tokens=TILE))(h, *args[1:])
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(loss, h, create_graph=True)


@pytest.mark.parametrize("fn", [ce_z_loss, per_token_log_probs], ids=["one_loss", "per_token"])
def test_bfloat16_model_no_worse_than_eager_and_split_sum_is_the_float32_sum(fn, monkeypatch):
    """bf16 weights: the weight gradient summed across tiles in two 16-bit planes (4 bytes per
    weight, the returned gradient included) is bit-for-bit the float32 sum's, in both ops
    (gradient formed in forward; re-derived in backward), and within eager's error."""
    import dataclasses

    from tile_pass import _settings
    from tile_pass.plan import _plan

    args = _inputs("cpu", dtype=torch.bfloat16)
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    compiled = torch.compile(fn, backend=backend)
    with _plan.recorded() as split:
        outs, grads = _run(compiled, args)
    monkeypatch.setattr(
        _settings, "_current", dataclasses.replace(_settings.current(), weight_grad_sum="float32")
    )
    with _plan.recorded() as float32:
        _, grads32 = _run(compiled, args)
    # the loop that forms the weight gradient (the last: in forward for one loss, else backward's)
    assert (split[-1].schedule.value, float32[-1].schedule.value) == ("split", "float32")
    assert "two 16-bit planes, rounded over the high one (4 bytes per weight" in (
        backend.report().rewrites[0].weight_grad_sum
    )
    torch.testing.assert_close(grads[1], grads32[1], rtol=0, atol=0)
    eager_outs, eager_grads = _run(fn, args)
    ref_outs, ref_grads = _oracle(fn, args)
    assert outs[0].dtype == eager_outs[0].dtype and grads[1].dtype == torch.bfloat16
    for out, eager, ref in zip(outs, eager_outs, ref_outs, strict=True):
        assert_no_worse_than_eager(out, eager, ref, "output")
    for grad, eager_grad, ref_grad in zip(grads, eager_grads, ref_grads, strict=True):
        assert_no_worse_than_eager(grad, eager_grad, ref_grad, "grad")


def test_autocast_z_loss_with_returned_logits():
    def step(h, w, y, *rest):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w)
            lse = logits.float().logsumexp(-1)
            loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1)) + 1e-4 * lse.pow(2).mean()
        return loss, logits

    args = _inputs("cpu")
    report = tile_pass.explain(step, *args)
    assert len(report.rewrites) == 1 and "autocast(bfloat16)" in report.rewrites[0].form, str(report)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    outs, grads = _run(compiled, args)
    eager_outs, eager_grads = _run(step, args)
    ref_outs, ref_grads = _oracle(lambda *a: step(*a)[0], args)  # float64 has no autocast
    assert outs[1].dtype == torch.bfloat16 and outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[1], eager_outs[1])  # the same bf16 GEMM
    assert_no_worse_than_eager(outs[0], eager_outs[0], ref_outs[0], "loss")


@pytest.mark.parametrize(
    "fn, tile, block_bytes_rows, middle_rows",
    [(ce_z_loss, TILE, None, None), (grpo_log_softmax_gather, TILE, None, None), (entropy_bonus, 16, 8, 8),
     (per_token_log_probs, 16, 8, 8), (kl_to_teacher, 32, 16, 8)],
    ids=["ce_z_loss", "grpo", "entropy_row_blocks", "per_token_row_blocks", "kl_row_blocks"],
)  # fmt: skip
def test_inductor_with_compiled_tiles(fn, tile, block_bytes_rows, middle_rows, monkeypatch):
    """Compiled tiles; with ``middle_rows`` the CPU's compiled middle runs in blocks of rows,
    as many as fit ``block_bytes_rows`` rows of logits with every ``[tile, V]`` input the
    middle reads (the KL's teacher logits halve them)."""
    from tile_pass.tiles._tile_passes import compiled_middle

    blocked_calls = []
    if middle_rows:
        monkeypatch.setattr(compiled_middle, "MIDDLE_BLOCK_BYTES", block_bytes_rows * V * 4)
        forward = compiled_middle._RowBlocked.forward

        def counted(self, *args):
            blocked_calls.append(self.rows)
            return forward(self, *args)

        monkeypatch.setattr(compiled_middle._RowBlocked, "forward", counted)
        tile_pass.clear_caches()
    args = _inputs("cpu")
    backend = tile_pass.backend("inductor", tile_tokens=tile)
    outs, grads = _run(torch.compile(fn, backend=backend), args)
    if middle_rows:
        tile_pass.clear_caches()
        assert blocked_calls and set(blocked_calls) == {middle_rows}
    rewrite = backend.report().rewrites[0]
    assert rewrite.compiled_tiles
    ref_outs, ref_grads = _oracle(fn, args)
    for out, ref in zip([*outs, *grads], [*ref_outs, *ref_grads], strict=True):
        assert_close_to_oracle(out, ref, torch.float32, fn.__name__)


def test_drop_logits_returns_a_placeholder_for_returned_rows():
    args = _inputs("cpu")
    backend = tile_pass.backend("aot_eager", tile_tokens=TILE, drop_logits=True)
    loss, logits = torch.compile(bias_in_place_returned, backend=backend)(*_trainable(args))
    assert "dropped" in backend.report().rewrites[0].returned_logits
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32 and torch.isnan(logits).all()
    (ref, _), _ = _oracle(bias_in_place_returned, args)
    assert_close_to_oracle(loss, ref, torch.float32, "loss")


def test_two_heads_in_one_graph_and_dynamic_lengths():
    def policy_and_reference(h, w, ref_h, ids, mask):  # a reference model's head under no_grad
        logp = torch.gather(F.linear(h, w), -1, ids.unsqueeze(-1)).squeeze(-1) - F.linear(h, w).logsumexp(-1)
        with torch.no_grad():
            ref_logits = F.linear(ref_h, w)
            ref_logp = ref_logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return ((logp - ref_logp) * mask).sum() / mask.sum()

    backend = tile_pass.backend("aot_eager", tile_tokens=TILE)
    compiled = torch.compile(policy_and_reference, backend=backend, dynamic=True)
    for length in (T, T + 6):
        h, w, _, ids, mask, *_ = _inputs("cpu")
        h = torch.cat([h, h[:, : length - T]], 1)
        ids, mask = torch.cat([ids, ids[:, : length - T]], 1), torch.cat([mask, mask[:, : length - T]], 1)
        args = (h, w, h.flip(1).contiguous(), ids, mask)
        (out,), grads = _run(compiled, args)
        (ref,), ref_grads = _oracle(policy_and_reference, args)
        assert_close_to_oracle(out, ref, torch.float32, "loss")
        for grad, ref_grad in zip(grads, ref_grads, strict=True):
            assert_close_to_oracle(grad, ref_grad, torch.float32, "grad")
    report = backend.report()
    assert not report.skipped and all(g.rewrites for g in report.graphs), str(report)
    # every head is tiled: the two trained projections meet row by row (gather - logsumexp), so they
    # share one region; the reference head joins it or has its own
    heads = sum(1 + r.form.count("head 2") + r.form.count("head 3") for r in report.graphs[0].rewrites)
    assert heads == 3, str(report)


# ---------------------------------------------------------------- the IR and the rules table


def test_no_match_formats_lazily_and_names_its_node():
    import torch.fx

    from tile_pass.match._fx import NoMatch, describe

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_method("cumsum", (x, -1))
    why = NoMatch("{} has no row-wise rule ({!r})", node, "cumsum")
    assert why.node is node and why.format_string == "{} has no row-wise rule ({!r})"
    assert why.format_args == (node, "cumsum")
    assert str(why) == f"{describe(node)} has no row-wise rule ('cumsum')"
    assert NoMatch("plain", node=x).node is x and NoMatch("plain").node is None


def test_enums_have_a_process_independent_canonical_form():
    from tile_pass.program import _region
    from tile_pass.program._region import Layout, Ref, RefKind, ZeroIf, ZeroKind

    assert _region._canonical(Layout.ROWS) == "Layout.ROWS" and Layout.ROWS == "rows"
    assert _region._canonical(Ref(RefKind.TOKEN, 2)) == "Ref(RefKind.TOKEN,2)"
    assert _region._canonical(ZeroIf(1, ZeroKind.EQUALS, -100)) == "ZeroIf(1,ZeroKind.EQUALS,-100,True)"
    assert _region.row_part("tokens1", 7) == _region.row_part(Layout.TOKENS1, 7) == (1,)


def test_every_rule_is_registered_once_per_op():
    from tile_pass.program import _op_facts
    from tile_pass.program._op_facts import RuleKind

    assert _op_facts.facts_for(torch.gather).kind is RuleKind.GATHER
    assert _op_facts.facts_for(F.kl_div).kind is RuleKind.LOSS
    facts = {name: getattr(_op_facts.FACTS["gather"], name) for name in _op_facts.FACT_NAMES}
    with pytest.raises(ValueError, match="already have facts"):
        _op_facts.register_ops("gather", kind=RuleKind.VIEW, **facts)(lambda matcher, node: [])
    assert _op_facts.facts_for("gather").kind is RuleKind.GATHER


def test_a_scalar_loss_beside_returned_half_logits_does_not_copy_them(monkeypatch):
    """The loss's reduction holds only the steps the loss is computed from: the graph's
    ``logits.float()`` feeds the region (the tiles), not the reduction, which once replayed it on
    the whole returned bf16 logits, a float32 ``[N, V]`` copy in forward (at N=4096, V=32000:
    750 MiB of forward peak instead of 298, measured in fresh processes)."""
    from tile_pass.program import _region

    registered = []
    real = _region.register
    monkeypatch.setattr(
        _region, "register", lambda program: registered.append(real(program)) or registered[-1]
    )

    def loss_and_logits(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float().view(-1, w.shape[0]), y.view(-1)), logits

    h = torch.randn(2, 8, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (2, 8))
    torch._dynamo.reset()
    loss, logits = torch.compile(loss_and_logits, backend=tile_pass.backend("aot_eager"))(h, w, y)
    (program,) = [p for p in registered if p.reduction is not None]
    names = [getattr(step.target, "__name__", step.target) for step in program.reduction.steps]
    assert names == ["restore", "after_tiles"], names
    eager_loss, eager_logits = loss_and_logits(h, w, y)
    torch.testing.assert_close(loss, eager_loss)
    assert torch.equal(logits, eager_logits)
