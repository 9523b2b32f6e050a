"""Tile functions of small regions, built as the pass builds them, for the tests of the tile
function's passes: the region's code is traced (``torch.fx.symbolic_trace``), given fake
example values as Dynamo gives them, and matched by the one matcher into a program; the key
names the tile size, dtypes and post-trace passes, and the kernel is the traced, finished tile
function of :mod:`tile_pass.tiles.tiled_region`."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tile_pass._textbook import _ExampleValues
from tile_pass.match._region_match import match_row_region
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program import _region
from tile_pass.tiles._tile_kernel import TileInputs, TileKernelKey
from tile_pass.tiles.tiled_region import _program_kernel

T, H, V = 32, 16, 96
CPU = torch.device("cpu")


def cross_entropy_code(
    *,
    upcast=False,
    softcap=None,
    label_smoothing=0.1,
    returns_logits=False,
    log_probs=False,
    temperature=None,
):
    """``(hidden, weight, bias, target, class_weights) -> (loss[, logits])``, the textbook head;
    with ``log_probs``, the per-token log-probabilities of RL losses instead of the loss
    (``log_softmax`` + ``gather`` of the targets, an ignored one clamped to class 0)."""

    def loss(hidden, weight, bias, target, class_weights):
        logits = F.linear(hidden, weight, bias)
        head = logits if softcap is None else torch.tanh(logits / softcap) * softcap
        head = head.float() if upcast else head
        head = head if temperature is None else head / temperature
        if log_probs:
            picked = head.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            return (picked, logits) if returns_logits else (picked,)
        ce = F.cross_entropy(
            head, target, weight=class_weights, reduction="none", label_smoothing=label_smoothing
        )
        return (ce, logits) if returns_logits else (ce,)

    return loss


#: the programs made here: the registry finds a program while something holds it
_held: list[_region.RowProgram] = []


def program_of(code, dtype, bias: bool, class_weights=False, vocab=V, hidden=H) -> _region.RowProgram:
    """The program the matcher builds for ``code`` on ``dtype`` inputs."""
    if bias and class_weights:
        pass
    elif bias:
        code = (lambda f: lambda hidden, weight, bias, target: f(hidden, weight, bias, target, None))(code)
    elif class_weights:
        code = (lambda f: lambda hidden, weight, target, cw: f(hidden, weight, None, target, cw))(code)
    else:
        code = (lambda f: lambda hidden, weight, target: f(hidden, weight, None, target, None))(code)
    graph_module = torch.fx.symbolic_trace(code)
    mode = FakeTensorMode()
    with mode:
        examples = [
            torch.empty(8, hidden, dtype=dtype, requires_grad=True),
            torch.empty(vocab, hidden, dtype=dtype, requires_grad=True),
            *([torch.empty(vocab, dtype=dtype, requires_grad=True)] if bias else []),
            torch.zeros(8, dtype=torch.long),
            *([torch.empty(vocab)] if class_weights else []),
        ]
    _ExampleValues(graph_module).run(*examples)
    projection = next(n for n in graph_module.graph.nodes if n.target is F.linear)
    program = match_row_region(graph_module.graph, projection).program
    _held.append(program)  # its key stands for a compiled graph here, which holds its program
    return program


def ce_key(
    dtype,
    *,
    bias=False,
    class_weights=False,
    compiled=True,
    need_hidden=True,
    onednn=False,
    weight_grad=WeightGradSchedule.FLOAT32,
    tile=T,
    vocab=V,
    hidden=H,
    **code_options,
) -> TileKernelKey:
    """The tile function's key for the textbook cross entropy (``code_options``: those of
    :func:`cross_entropy_code`) with these dtypes, sizes and passes."""
    program = program_of(cross_entropy_code(**code_options), dtype, bias, class_weights, vocab, hidden)
    return TileKernelKey(
        program=program.key,
        tile=tile,
        hidden_size=hidden,
        vocab_size=vocab,
        hidden_dtype=dtype,
        weight_dtype=dtype,
        bias_dtype=dtype if bias else None,
        token_inputs=tuple(
            (_region.row_part(layout, vocab), torch.int64) for layout in program.token_layouts
        ),
        row_inputs=(((vocab,), torch.float32),) if class_weights else (),
        tangents=tuple(i for i, out in enumerate(program.outputs) if out.differentiable),
        device=CPU,
        need_hidden=need_hidden,
        need_weight=True,
        need_bias=bias,
        acc_dtype=torch.float32,
        compiled=compiled,
        onednn=onednn,
        weight_grad=weight_grad,
    )


def kernel(key: TileKernelKey) -> torch.fx.GraphModule:
    return _program_kernel(key)


def replace(key: TileKernelKey, **changes) -> TileKernelKey:
    return dataclasses.replace(key, **changes)


def make_inputs(key: TileKernelKey, seed=0):
    """``(hidden, weight, bias, target, coef, weight_acc, bias_acc)``, the sums not zero."""
    gen = torch.Generator().manual_seed(seed)
    tile, hidden_size, vocab = key.tile, key.hidden_size, key.vocab_size
    hidden = torch.randn(tile, hidden_size, generator=gen).to(key.hidden_dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen).to(key.weight_dtype)
    bias = torch.randn(vocab, generator=gen).to(key.bias_dtype) if key.bias_dtype is not None else None
    target = torch.randint(0, vocab, (tile,), generator=gen)
    target[::5] = -100
    coef = torch.rand(tile, generator=gen)
    weight_acc = torch.randn(vocab, hidden_size, generator=gen)  # accumulation adds to what is there
    bias_acc = torch.randn(vocab, generator=gen) if bias is not None else None
    return hidden, weight, bias, target, coef, weight_acc, bias_acc


def call(key: TileKernelKey, hidden, weight, bias, target, coef, weight_acc, bias_acc, class_weights=None):
    """The tile function on these inputs: ``(outputs, grad hidden, grad weight if returned)``."""
    program = _region.lookup(key.program)
    if program.token_layouts == ("tokens1",):  # a gather's index, made outside the region
        target = target.clamp(min=0).unsqueeze(1)
    summed = key.need_weight and key.weight_grad is WeightGradSchedule.FLOAT32
    inputs = TileInputs(
        hidden=hidden,
        weight=weight,
        bias=bias if key.bias_dtype is not None else None,
        token_inputs=(target,),
        row_inputs=(class_weights,) if key.row_inputs else (),
        tangents=tuple(coef.to(program.outputs[i].dtype) for i in key.tangents),
        weight_grad_sum=(weight_acc,) if summed else (),
        bias_grad_sum=bias_acc if key.need_bias else None,
    )
    result = list(kernel(key)(*inputs.flat()))
    outputs = [result.pop(0) for _ in program.outputs]
    grad_hidden = result.pop(0) if key.need_hidden else None
    direct = key.need_weight and key.weight_grad is WeightGradSchedule.DIRECT
    grad_weight = result.pop(0) if direct else None
    return outputs, grad_hidden, grad_weight


def run(key: TileKernelKey, seed=0):
    """(per-token losses, grad hidden, weight sum, bias sum, returned logits or None) of one tile."""
    inputs = make_inputs(key, seed)
    outputs, grad_hidden, _ = call(key, *inputs)
    layouts = [out.layout for out in _region.lookup(key.program).outputs]
    losses = outputs[layouts.index("tokens")]
    logits = outputs[layouts.index("rows")] if "rows" in layouts else None
    return losses, grad_hidden, inputs[5], inputs[6], logits


def graph_calls(graph_module: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    modules = [m for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    return [n for m in modules for n in m.graph.nodes if n.target is target]


def key_for(dtype, upcast=False, softcap=None, bias=False, returns_logits=False, compiled=True,
            need_hidden=True, onednn=False):  # fmt: skip
    return ce_key(dtype, upcast=upcast, softcap=softcap, bias=bias, returns_logits=returns_logits,
                  compiled=compiled, need_hidden=need_hidden, onednn=onednn)  # fmt: skip


def middle_of(key):
    """The compiled middle of a key's tile function."""
    from tile_pass.tiles._tile_passes.compiled_middle import Compiled

    middle = kernel(key).get_submodule("submod_1")
    assert isinstance(middle, Compiled)
    return middle


CASES = {
    "float32": dict(dtype=torch.float32),
    "bf16-upcast-bias": dict(dtype=torch.bfloat16, upcast=True, bias=True),
    "softcap": dict(dtype=torch.float32, softcap=30.0),
    "no-hidden-grad": dict(dtype=torch.float32, need_hidden=False),
}
