"""A vocabulary-sharded LM head (torchtitan's ``ColwiseParallel(output_layouts=Shard(-1))``): this
rank's piece of it, and the region's steps in their group-wide form on that piece."""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
import torch.fx

from tile_pass._distributed import VOCAB_SHARD_META, shard_elementwise, shard_rows
from tile_pass.match._fx import NoMatch, val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.program._op_facts import facts_for
from tile_pass.program._region import Layout, Ref, RefKind, Step

_PER_TOKEN = (Layout.TOKENS, Layout.TOKENS1)

#: ``(group name, first row, rows)`` of this rank's piece of the head's weight
HeadShard = tuple[str, int, int]


def head_shard(hidden: torch.fx.Node, weight, projection: torch.fx.Node) -> HeadShard | None:
    """The shard of the head ``projection`` (of ``hidden`` by ``weight``): from its DTensors' placements,
    or given on the weight by the functional API; None for a whole head. ``NoMatch`` for a
    DTensor head sharded otherwise."""
    hidden_val, weight_val, out_val = val(hidden), val(weight), val(projection)
    if hidden_val is None or weight_val is None or out_val is None or weight_val.dim() != 2:
        return None  # the matcher says why
    if any(hasattr(v, "placements") for v in (hidden_val, weight_val, out_val)):
        return vocab_shard(hidden_val, weight_val, out_val)
    if isinstance(weight, torch.fx.Node):  # given explicitly (the functional API)
        return weight.meta.get(VOCAB_SHARD_META)
    return None


def vocab_shard(hidden, weight, out) -> tuple[str, int, int]:
    """``(group name, first row, rows)`` of this rank's piece of a vocabulary-sharded head
    (torchtitan's ``ColwiseParallel(output_layouts=Shard(-1))``); ``NoMatch`` otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise NoMatch(
            "the DTensor LM head is not sharded over the vocabulary (Shard(0)) on a 1-D tensor-parallel mesh"
        )
    if tuple(getattr(hidden, "placements", ())) != (Replicate(),) or hidden.device_mesh != mesh:
        raise NoMatch("the hidden states of the vocabulary-sharded head are not replicated over its mesh")
    if tuple(getattr(out, "placements", ())) not in ((Shard(out.dim() - 1),), (Shard(-1),)):
        raise NoMatch("the vocabulary-sharded head's logits are not sharded over the vocabulary")
    start, rows = shard_rows(int(weight.shape[0]), mesh.size(), mesh.get_local_rank())
    return mesh.get_group().group_name, start, rows


def no_op_redistribute(node: torch.fx.Node) -> bool:
    """``x.redistribute(...)`` of a DTensor that keeps its mesh and placements (ColwiseParallel's
    output hook with ``Shard(-1)`` kept)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op not in ("call_method", "call_function") or name not in ("redistribute", "prim_redistribute"):
        return False  # torch 2.11's Dynamo records the call as the function ``prim_redistribute``
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    out, inp = val(node), val(node.args[0])
    placements = [getattr(v, "placements", None) for v in (out, inp)]
    meshes = [getattr(v, "device_mesh", None) for v in (out, inp)]
    return placements[0] is not None and placements[0] == placements[1] and meshes[0] == meshes[1]


def shard_program_steps(matcher: RegionMatcher) -> list[Step]:
    """The region's steps on this rank's ``[tile, V_r]`` logits: each step over the vocabulary
    in its group-wide form (:func:`shard_step`), reshapes of rows to the shard's width; ``NoMatch``
    naming what has no sharded form."""
    group_name, start, rows = matcher.shard
    if matcher.autocast_dtype is not None:
        raise NoMatch("autocast around a vocabulary-sharded head is not tiled in tensor-parallel form yet")
    if matcher.bias is not None:
        raise NoMatch("a vocabulary-sharded head with a bias is not tiled in tensor-parallel form yet")
    # a partner head sharded alike projects this rank's rows of its own weight from its hidden states
    theirs = {id(operand) for operand in matcher.partner_inputs}
    for token_input in matcher.token_inputs:
        if token_input.part not in ((), (1,)) and id(token_input) not in theirs:  # a label, an index, a mask
            raise NoMatch("a [tokens, V] operand (a teacher's logits) is not sharded with the head yet")
    if any(not row.zero_dim and id(row) not in theirs for row in matcher.row_inputs):
        raise NoMatch("a [V] operand of the logits is not sharded with the head yet")
    steps = []

    def layout(arg) -> Layout | None:  # of a value the step reads
        is_value = isinstance(arg, Ref) and arg.kind is RefKind.VALUE
        return matcher.program[arg.index].shape.layout if is_value else None

    for value in matcher.program[1:]:
        step = value.step
        reads_rows = bool(step.args) and layout(step.args[0]) is Layout.ROWS
        if reads_rows and value.kind.over_vocab:
            sharded = shard_step(step, group_name, start, int(matcher.vocab))
            if sharded is None:
                raise NoMatch("{} ({}) has no tensor-parallel form yet", step.describe(), step.source)
            step = sharded
        elif reads_rows and step.target == "reshape" and value.shape.layout is Layout.ROWS:
            step = replace(step, args=(*step.args[:-1], rows))
        elif value.shape.layout is Layout.ROWS:  # an elementwise step of the rows
            replicated = tuple(i for i, a in enumerate(step.args) if layout(a) in _PER_TOKEN)
            if any(isinstance(v, Ref) and v.kind is RefKind.VALUE for _, v in step.kwargs):
                raise NoMatch("{} ({}) takes a computed value by keyword", step.describe(), step.source)
            if replicated:
                args = (step.target, step.op, replicated, group_name, *step.args)
                step = replace(step, op="call_function", target=shard_elementwise, args=args)
        steps.append(step)
    return steps


def shard_step(step: Step, group_name: str, vocab_start: int, vocab_size: int) -> Step | None:
    """The group-wide form of a region step over the vocabulary (its op's ``sharded`` fact, a
    function registered with the op), or ``None`` where there is none (the caller declines the
    region, naming the op)."""
    kwargs = dict(step.kwargs)
    facts = facts_for(step.target)
    if facts is None or facts.sharded is None or "weight" in kwargs:
        return None
    shard = {"group_name": group_name}
    parameters = inspect.signature(facts.sharded).parameters
    if "vocab_start" in parameters:
        shard["vocab_start"] = vocab_start
    if "vocab_size" in parameters:
        shard["vocab_size"] = vocab_size
    return replace(step, op="call_function", target=facts.sharded, kwargs=tuple({**kwargs, **shard}.items()))
