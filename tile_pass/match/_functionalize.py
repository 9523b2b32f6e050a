"""Replay in-place writes to values computed in the graph out of place, before matching.

RL actors scale their logits in place (verl's ``logits.div_(temperature)``; NeMo-RL's too) and
then read them by the same name: in Dynamo's graph the readers after the write take the node the
write mutated, not the write's result, so the row-wise region sees a value that is read whole
and changed under another name. Functionalization (what AOTAutograd does on the aten graph, here
on Dynamo's torch-level graph) makes each reader take the version eager gives it: the write
becomes its out-of-place op, and every reader after it reads the new node.

Only writes whose result is certain to be the same are replayed; a write is left as it is,
and the matcher then says why its region stops, when:

* the written memory belongs to a graph input or parameter (the caller sees the write);
* another name for that memory, taken before the write, is read after it (a view would have to
  be taken again of the new value);
* anything reads the memory's value before the write (the write might change a value autograd
  saved, which eager reports as an error at backward: replaying it would hide that error);
* the memory's producer keeps its own result for its backward (``exp``, ``softmax``: eager's
  error again), i.e. it is neither a projection, a view or cast, nor an op linear in its input;
* the out-of-place op would give another dtype or shape than the in-place one (``bf16.add_(f32)``).

Which spellings write in place, and the op each is replayed as, come from the op registry
(:func:`tile_pass.program._op_facts.spelling`); the op's facts must allow it (``inplace``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from tile_pass._logging import log
from tile_pass.match._fx import val
from tile_pass.program._op_facts import FACTS, spelling

#: ``node.meta`` key of a write left in place: why, as ``NoMatch`` takes it (a format string, its nodes)
KEPT_IN_PLACE = "tile_pass_kept_in_place"


def functionalize_writes(gm: torch.fx.GraphModule) -> int:
    """Replay every in-place write of ``gm`` that is certainly exact out of place; the number replayed.

    Writes are taken in graph order, so a chain (``x.mul_(2).add_(1)``) is replayed write by write:
    each sees the memory its predecessor's out-of-place result now owns."""
    memory = _memory_of(gm.graph)
    replayed = 0
    for node in list(gm.graph.nodes):
        if _writable(node) and _replay(node, memory):
            replayed += 1
    if replayed:
        gm.graph.lint()
        gm.recompile()
        log.debug("replayed %d in-place write(s) out of place", replayed)
    return replayed


def _memory_of(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Which memory each tensor node's value lives in, from Dynamo's example values (fake tensors
    share storage exactly as eager's tensors would). Read once: a replayed write moves the names
    after it to its own result's memory (:func:`_replay`), which stale example values do not say."""
    memory = {}
    for node in graph.nodes:
        value = val(node)
        if value is not None:
            try:
                memory[node] = value.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                pass
    return memory


def _writable(node: torch.fx.Node) -> bool:
    """An in-place spelling of an op whose facts allow replaying it out of place, or a masked
    write ``x[mask] = value`` (see :func:`_as_call`)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if node.target is operator.setitem:
        return _masked_write(node)
    spelled = spelling(node.target)
    if spelled is None or not spelled.inplace:
        return False
    facts = FACTS.get(spelled.key)
    return facts is not None and facts.inplace and isinstance(node.args[0], torch.fx.Node)


def _masked_write(node: torch.fx.Node) -> bool:
    """``x[mask] = value``: a boolean mask of ``x``'s own shape and a number, the write that
    ``x.masked_fill(mask, value)`` replays out of place (torchtune's ``labels[labels == -100] = 0``,
    ``logprobs[padding] = 1.0``)."""
    target, index, value = node.args
    mask = val(index) if isinstance(index, torch.fx.Node) else None
    written = val(target) if isinstance(target, torch.fx.Node) else None
    return (
        mask is not None and written is not None and mask.dtype == torch.bool
        and tuple(mask.shape) == tuple(written.shape) and isinstance(value, (int, float, bool))
    )  # fmt: skip


def _as_call(write: torch.fx.Node) -> tuple[str, object, tuple]:
    """``(op, target, args)`` of the out-of-place call that replays ``write``."""
    if write.target is operator.setitem:
        return "call_method", "masked_fill", write.args
    return write.op, spelling(write.target).out_of_place, write.args


def _replay(write: torch.fx.Node, memory: dict[torch.fx.Node, int]) -> bool:
    why = _why_kept(write, memory)
    replacement = _out_of_place(write) if why is None else None
    if replacement is None:
        write.meta[KEPT_IN_PLACE] = why or (
            "{} has no out-of-place form the pass can prove of the same dtype and shape", (write,)
        )
        return False
    mutated, order = write.args[0], {n: i for i, n in enumerate(write.graph.nodes)}
    here, written = order[write], memory[mutated]
    for reader in list(mutated.users):
        if reader is not replacement and order[reader] > here:
            reader.replace_input_with(mutated, replacement)
    write.replace_all_uses_with(replacement)
    new_memory = min(0, *memory.values()) - 1  # the replacement's own: the names after the write live there
    for name, where in list(memory.items()):
        if where == written and order.get(name, -1) > here:
            memory[name] = new_memory
    memory[replacement] = new_memory
    memory.pop(write, None)
    write.graph.erase_node(write)
    return True


def _why_kept(write: torch.fx.Node, memory: dict[torch.fx.Node, int]) -> tuple[str, tuple] | None:
    """Why replaying ``write`` out of place might not give eager's values and errors (a format
    string and its nodes, as ``NoMatch`` takes them), or ``None``."""
    mutated = write.args[0]
    written = memory.get(mutated)
    if written is None or (write.target is not operator.setitem and memory.get(write) != written):
        return "{} writes into memory the pass cannot follow", (write,)
    order = {n: i for i, n in enumerate(write.graph.nodes)}
    here = order[write]
    names = [n for n in write.graph.nodes if memory.get(n) == written]
    if outside := next((n for n in names if n.op in ("placeholder", "get_attr")), None):
        return ("{} writes in place into {}, which comes from outside the graph: the caller sees the write",
                (write, outside))  # fmt: skip
    if _autograd_keeps(names[0], None):
        return ("{} writes in place over the result of {}, which autograd keeps for its backward (eager "
                "raises there at backward); compute it out of place", (write, names[0]))  # fmt: skip
    for name in names:
        if order[name] >= here:
            continue  # taken after the write, from the mutated name (redirected) or the write
        for reader in name.users:
            if reader is write:
                continue
            if order[reader] > here and name is not mutated:
                return ("{} changes the logits in place while {}, after it, reads them through another name",
                        (write, reader))  # fmt: skip
            if order[reader] < here and reader not in names and _autograd_keeps(reader, name):
                return ("{} changes the logits in place after {} read them and autograd kept them for its "
                        "backward (eager raises there at backward)", (write, reader))  # fmt: skip
    return None


def _autograd_keeps(node: torch.fx.Node, operand: torch.fx.Node | None) -> bool:
    """Whether autograd, running ``node``'s op as eager does with every floating input requiring a
    gradient, keeps ``operand``'s memory (its result's, for ``None``) for the backward. Asked of
    autograd itself, on fake tensors: the saved values of the op's backward nodes are compared by
    storage. An op the fake mode cannot run counts as keeping it."""
    if node.op not in ("call_function", "call_method"):
        return node.op != "placeholder"
    fake_mode = _fake_mode(node)
    if fake_mode is None:
        return True
    try:
        with fake_mode, torch.enable_grad():
            leaves = {}

            def leaf(n: torch.fx.Node):
                value = n.meta.get("example_value", n.meta.get("val"))
                if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                    value = leaves.setdefault(n, value.detach().requires_grad_())
                return value

            args, kwargs = map_arg(node.args, leaf), map_arg(node.kwargs, leaf)
            result = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" else (
                node.target(*args, **kwargs))  # fmt: skip
            outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            watched = outputs if operand is None else [leaves[operand]] if operand in leaves else []
            return bool(_saved_storages(outputs) & {t.untyped_storage()._cdata for t in watched})
    except Exception:  # noqa: BLE001  an op the fake mode cannot run, or unforeseen arguments
        return True


def _saved_storages(outputs: list[torch.Tensor]) -> set[int]:
    """The storages of every value the backward graph of ``outputs`` keeps, down to the leaves."""
    kept, seen = set(), set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                for value in pytree.tree_leaves(getattr(fn, name)):
                    if isinstance(value, torch.Tensor):
                        kept.add(value.untyped_storage()._cdata)
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return kept


def _fake_mode(node: torch.fx.Node):
    values = (val(n) for n in (node, *node.all_input_nodes))
    value = next((v for v in values if v is not None), None)
    return getattr(getattr(value, "_local_tensor", value), "fake_mode", None)  # a DTensor's: its local's


def _out_of_place(write: torch.fx.Node) -> torch.fx.Node | None:
    """The write's out-of-place op, after it, with its own example value; ``None`` if it would
    differ from the write in dtype or shape."""
    before = val(write.args[0])
    op, target, node_args = _as_call(write)
    args = map_arg(node_args, lambda n: n.meta.get("example_value", n.meta.get("val")))
    kwargs = map_arg(write.kwargs, lambda n: n.meta.get("example_value", n.meta.get("val")))
    fake_mode = _fake_mode(write)
    if fake_mode is None:
        return None
    try:
        with fake_mode:
            if op == "call_method":
                value = getattr(args[0], target)(*args[1:], **kwargs)
            else:
                value = target(*args, **kwargs)
    except Exception:  # noqa: BLE001  an op the fake mode cannot run: leave the write as it is
        return None
    if not isinstance(value, torch.Tensor) or value.dtype != before.dtype or value.shape != before.shape:
        return None
    with write.graph.inserting_after(write):
        replacement = write.graph.create_node(op, target, node_args, write.kwargs)
    replacement.meta = {**write.meta, "example_value": value}
    replacement.meta.pop("val", None)
    return replacement
