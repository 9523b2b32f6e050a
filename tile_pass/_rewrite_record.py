"""A rewritten region's record (:class:`tile_pass.report.Rewrite`), built from the matched region and
the tile plan the loop will make for it: what the driver (:mod:`tile_pass.rewrite`) reports of each
rewrite. The record's types and their text live in :mod:`tile_pass.report`; this is the arithmetic
and wording that fill one (bytes avoided, tiles, the loss's reduction, the weight-gradient sum)."""

from __future__ import annotations

import torch

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11/2.12: the same unguarded hint, under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

from tile_pass.match._fx import source_line, val
from tile_pass.match._records import describe_output
from tile_pass.match._rule_base import LOSS_SIGNATURES, bind
from tile_pass.plan import _weight_grad
from tile_pass.plan._plan import plan_tiles
from tile_pass.plan._tiling import TileSize
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program._op_facts import RuleKind, facts_for
from tile_pass.program._region import Layout, Step
from tile_pass.report import Rewrite, logits_bytes_fields


def rewrite_record(
    graph: int,
    region,
    logits: torch.Tensor,
    splice,
    covered: set,
    tile: TileSize,
    loss_line: str,
    options,
) -> Rewrite:
    """The report's record of one rewritten region: the plan the tile loop will make for the sizes'
    hints (the same :func:`tile_pass.plan._plan.plan_tiles`), the bytes it avoids, how it was spliced."""
    dtype, vocab, num_tokens = logits.dtype, region.program.vocab_size, region.num_tokens
    weight, tokens = val(region.weight), optimization_hint(num_tokens, fallback=8192)  # unguarded hints
    # the loop's head: this rank's vocabulary rows when sharded
    shape = (optimization_hint(vocab, fallback=4096), optimization_hint(weight.shape[1], fallback=4096))
    tile_plan = plan_tiles(tokens, tokens, tile, shape, dtype, weight.device, options.compile_tiles)
    backward = any(o.differentiable for o in region.outputs)  # none under torch.no_grad()
    returned = [val(o.node) for o in region.outputs if o.shape.layout is Layout.ROWS]
    returned += [val(node) for node in region.kept_whole]
    kept = sum(value.numel() * value.element_size() for value in returned)
    outputs = ", ".join(f"{describe_output(o)}" for o in region.outputs)
    shard = region.program.shard  # a vocabulary-sharded head: bytes are this rank's
    parallel = ""
    if shard is not None:
        degree = torch.distributed.distributed_c10d._resolve_process_group(shard[0]).size()
        parallel = (f" [tensor-parallel: degree {degree}, this rank's vocabulary rows {shard[1]}.."
                    f"{shard[1] + vocab - 1}; bytes per rank]")  # fmt: skip
    return Rewrite(
        graph=graph,
        matmul_source=source_line(region.projection),
        loss_source=loss_line,
        form=" -> ".join(region.steps_text) + f" => {outputs}" + parallel,
        num_tokens=_plain(num_tokens),
        hidden_size=_plain(weight.shape[1]),
        vocab_size=_plain(vocab if shard is None else shard[2]),
        dtype=str(dtype).replace("torch.", ""),
        reduction=_reduction_text(region, covered, backward),
        tile_tokens=tile_plan.tile,
        num_tiles=_plain((num_tokens + tile_plan.tile - 1) // tile_plan.tile),
        **logits_bytes_fields(
            num_tokens * vocab,
            dtype.itemsize,
            kept,
            tile_plan.tile_bytes,
            _plain,
            backward=backward,
            grad_buffer=_gradients_formed(region, tile_plan, tokens, shape, dtype),
        ),
        returned_logits=splice.returned_logits,
        returned_logits_bytes=_plain(kept),
        compiled_tiles=options.compile_tiles,
        weight_grad_sum=_weight_grad_sum(
            tile_plan.schedule if weight.requires_grad and backward else None, dtype
        ),
        token_skipping=_token_skipping(region),
        backward=backward,
        loss_grad_ops=_loss_grad_ops(region.program),
    )


def _gradients_formed(region, tile_plan, num_tokens, head_shape, dtype):
    """Bytes of the gradients the tile loop forms while its buffers live: the weight's sum under
    its schedule and the hidden states' (one row a token), where they need one."""
    weight, hidden = val(region.weight), val(region.hidden)
    held = 0
    if weight is not None and weight.requires_grad:
        held += _weight_grad.bytes_per_weight(tile_plan.schedule, dtype) * head_shape[0] * head_shape[1]
    if hidden is not None and hidden.requires_grad:
        held += num_tokens * head_shape[1] * hidden.dtype.itemsize
    return held


def _loss_grad_ops(program) -> str:
    """The ops that turn each row of ``[N, V]`` values into per-token values, whose ``[N, V]``
    input gradient an unfused backward makes (a cross entropy's is ``nll_loss``'s)."""
    facts = {step.target: found for step in program.steps if (found := facts_for(step.target)) is not None}
    losses = {"nll_loss" if f.key in ("cross_entropy", "nll_loss") else f.key: None
              for f in facts.values() if f.kind is RuleKind.LOSS}  # fmt: skip
    if losses:  # a cross entropy's is nll_loss's; a KL's, kl_div's
        return " and ".join(losses)
    reads = (RuleKind.GATHER, RuleKind.VOCAB_REDUCTION)
    names = {Step.describe(step): None for step in program.steps
             if step.target in facts and facts[step.target].kind in reads}  # fmt: skip
    return " and ".join(names) or "the loss"


def _reduction_text(region, covered: set, backward: bool = True) -> str:
    """The eager reduction of the region's one loss call when that loss is all it computes
    (beside returned logits), else the steps of a hand-written scalar loss's reduction,
    and whether the op forms the loss's gradient in forward (one scalar), in backward, or not at all."""
    calls = [n for n in covered if n.op == "call_function" and n.target in LOSS_SIGNATURES]
    eager = None
    if len(calls) == 1 and [o.node for o in region.outputs if o.shape.layout is not Layout.ROWS] == calls:
        options = bind(LOSS_SIGNATURES[calls[0].target], calls[0])
        eager = options["reduction"] if isinstance(options["reduction"], str) else None
    if region.program.reduction is not None:
        scalar = "one scalar loss (its gradient formed in forward)"
        if not region.program.reduction.linear:
            scalar = ("one scalar loss, nonlinear in the tokens' outputs (its gradient formed in forward, "
                      "each tile holding the tokens the loss couples, or a group longer than a tile in "
                      "per-summary sums; where neither applies, two passes: the debug log says which "
                      "ran)")  # fmt: skip
        steps = " -> ".join(
            step.describe()
            for step in region.program.reduction.steps  # the user's ops
            if not getattr(step.target, "__module__", "").startswith("tile_pass")
        )
        return f"{eager or steps or 'its own steps'}: {scalar}"
    if not backward:
        return eager or "per-token outputs (no gradient: no output needs one, so no backward runs)"
    return eager or "per-token outputs (gradient re-derived in backward)"


_SCHEDULE_TEXT = {
    WeightGradSchedule.DIRECT: "formed by the only tile's GEMM, no sum across tiles",
    WeightGradSchedule.SPLIT: "float32 sum in two 16-bit planes, rounded over the high one",
    WeightGradSchedule.FLOAT32: "float32 sum",
}


def _weight_grad_sum(schedule: WeightGradSchedule | None, dtype: torch.dtype) -> str:
    """How the tiles will form the weight gradient, and what it holds (see _weight_grad)."""
    if schedule is None:
        return "none"
    what = _SCHEDULE_TEXT[schedule]
    if schedule is WeightGradSchedule.FLOAT32 and dtype == torch.float64:
        what = "float64 sum"
    elif schedule is WeightGradSchedule.FLOAT32 and dtype != torch.float32:
        what += ", rounded into a separate gradient"
    held = _weight_grad.bytes_per_weight(schedule, dtype)
    return f"{what} ({held} bytes per weight at the end of the loop, the returned gradient included)"


def _token_skipping(region) -> str:
    """Which tokens the tiles may leave out (``_tile_loop.skipped_rows`` decides per batch), or
    the output that makes every token run: a token is left out only where every output is zero
    whatever its logits, or reaches the loss with a zero token weight."""
    outputs = list(zip(region.outputs, region.program.outputs, strict=True))
    rows = [found for found, out in outputs if out.layout is Layout.ROWS]
    if rows:
        return f"none: the graph returns the logits of every token ({rows[0].node.name})"
    always = [found for found, out in outputs if out.zeros is None and not out.only_loss]
    if always:
        return (
            f"none: {always[0].node.name} is read outside the loss and is not zero at an ignored label or a "
            "zero mask"
        )
    kinds = [
        "an ignored label or a zero mask" if any(out.zeros is not None for _, out in outputs) else "",
        "a zero token weight in the loss" if any(o.only_loss and o.zeros is None for _, o in outputs) else "",
    ]
    return (
        f"on CPU, tokens where every output is zero ({' or '.join(filter(None, kinds))}) run no GEMM; "
        "an accelerator runs every token (finding them would synchronise with the host)"
    )


def _plain(value) -> int | str:
    hint = None if isinstance(value, int) else value.node.hint  # None: an unbacked size has no value
    return value if isinstance(value, int) else str(value) if hint is None else f"{value} ({hint} at compile)"
