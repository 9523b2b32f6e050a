"""Building the program: the region's steps, outputs and scalar loss as one registered
:class:`~tile_pass.program._region.RowProgram` (in its tensor-parallel form for a sharded head),
and the :class:`~tile_pass.match._records.RowRegion` record the splice reads."""

from __future__ import annotations

from tile_pass.match._fx import NoMatch, as_linear, val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._records import RegionOutput, RegionOutputs, RowRegion
from tile_pass.match._scalar_loss import ScalarLoss
from tile_pass.match._sharding import shard_program_steps
from tile_pass.program import _region
from tile_pass.program._region import Layout, Output, ReductionProgram, RowProgram


def build_region(matcher: RegionMatcher, found: RegionOutputs, loss: ScalarLoss | None) -> RowRegion:
    """The program of the walked region ``matcher`` with the outputs ``found`` (and ``loss``
    joined to the op, if there is one), registered, and the region's record."""
    outputs = found.outputs
    steps_text = _steps_text(matcher, outputs)
    program = _region.register(_program(matcher, outputs, loss, " -> ".join(steps_text)))
    return RowRegion(
        projection=matcher.projection, hidden=matcher.hidden, weight=matcher.weight, bias=matcher.bias,
        autocast_dtype=matcher.autocast_dtype,
        nodes=[*matcher.values, *(n for n in (matcher.transpose, *matcher.partners.values()) if n)],
        token_inputs=matcher.token_inputs, row_inputs=matcher.row_inputs, outputs=outputs, program=program,
        reduction_nodes=loss.nodes if loss else [], sink=loss.sink if loss else None,
        reduce_inputs=loss.inputs if loss else [], steps_text=steps_text,
        dropped=found.dropped, kept_whole=found.kept_whole, slices=matcher.slices,
        left_to_graph=[n for n in matcher.graph.nodes if n in matcher.left_to_graph],
        num_tokens=matcher.num_tokens,
    )  # fmt: skip


def _steps_text(matcher: RegionMatcher, outputs: list[RegionOutput]) -> list[str]:
    """The region's steps as the report shows them: the head, each step (another head's logits
    by its number), the token slices where they were taken, the row selections."""
    steps_text = [matcher.head_form if matcher.autocast_dtype is None
                  else f"autocast({str(matcher.autocast_dtype)[6:]}) {matcher.head_form}"]  # fmt: skip
    partner_of = {matcher.values[p].value.index: p for p in matcher.partners}
    head_number = {index: k for k, index in enumerate(sorted(partner_of), start=2)}
    for value in matcher.program[1:]:
        shown = value.step.describe()
        if value.index in partner_of:  # another head's logits, computed in the same tiles
            trained = val(partner_of[value.index]).requires_grad
            shown = (f"head {head_number[value.index]} ({as_linear(partner_of[value.index])[4]}, "
                     f"{value.step.source}, {'trained' if trained else 'no gradient'})")  # fmt: skip
        steps_text += ["slice tokens"] * matcher.slice_steps.count(value.index) + [shown]
    # the selections the tiles' operands and outputs are read with (not the views between them)
    read = dict.fromkeys(
        x.subset.describe() for x in (*matcher.token_inputs, *outputs) if x.subset is not None
    )
    if read:
        steps_text.append(f"row selections {', '.join(read)}")
    return steps_text


def _token_layout(part: tuple) -> Layout:
    """A per-token input's layout in a tile, from its shape after the token dims (a partner
    head's hidden size may be symbolic: no hashing)."""
    if not part:
        return Layout.TOKENS
    return Layout.TOKENS1 if len(part) == 1 and type(part[0]) is int and part[0] == 1 else Layout.ROWS


def _program(
    matcher: RegionMatcher, outputs: list[RegionOutput], loss: ScalarLoss | None, form: str
) -> RowProgram:
    in_loss = set(loss.nodes) if loss else set()
    sink = loss.sink if loss else None

    def zeros(o):  # where the output is zero whatever the logits: tokens the tiles may skip
        return matcher.program[o.value].zeros if o.shape.layout is not Layout.ROWS else None

    program_outputs = tuple(
        Output(o.value, o.shape.layout, val(o.node).dtype,
               o.differentiable and o.shape.layout is not Layout.ROWS, zeros=zeros(o),
               only_loss=o.node is sink or bool(in_loss) and all(u in in_loss for u in o.node.users))
        for o in outputs
    )  # fmt: skip
    finish = ReductionProgram(loss.steps, loss.result, val(loss.sink).dtype, loss.linear) if loss else None
    steps = tuple(value.step for value in matcher.program[1:])
    vocab_size, shard = int(matcher.vocab), None
    if matcher.shard is not None:
        if any(o.shape.layout is Layout.ROWS for o in outputs):
            raise NoMatch("logits returned from a vocabulary-sharded head are not tiled in tensor-parallel "
                          "form yet")  # fmt: skip
        steps = tuple(shard_program_steps(matcher))
        vocab_size, shard = matcher.shard[2], (*matcher.shard[:2], int(matcher.vocab))
    return RowProgram(
        steps=steps, outputs=program_outputs, vocab_size=vocab_size, shard=shard,
        token_layouts=tuple(_token_layout(t.part) for t in matcher.token_inputs),
        has_bias=matcher.bias is not None, bias_added=matcher.bias_added,
        index_checks=tuple(matcher.index_checks), reduction=finish, form=form,
    )  # fmt: skip
