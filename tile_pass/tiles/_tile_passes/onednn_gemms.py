"""A CPU tile's float32 GEMMs through oneDNN (``TILE_PASS_CPU_GEMM``, see :mod:`tile_pass._settings`)."""

from __future__ import annotations

import functools

import torch
import torch.fx

from tile_pass import _settings
from tile_pass._logging import log
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes._graph import GEMMS, aten, graph_nodes, recompile_all, replace_with_call


def onednn_gemms_apply(device: torch.device) -> bool:
    """Whether a CPU tile runs its float32 ``mm`` GEMMs through oneDNN (see :func:`_onednn_mm`);
    ``TILE_PASS_CPU_GEMM`` decides, read once (see :mod:`tile_pass._settings`)."""
    return _settings.current().cpu_gemm == "onednn" and device.type == "cpu" and _onednn_linear() is not None


@functools.cache
def _onednn_linear():
    """``mkldnn::_linear_pointwise`` (the op Inductor's CPU linear fusion calls), if this build has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def _onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` by oneDNN's matmul: the same float32 product as ``aten.mm``, summed
    in a different order.

    A tile's logits GEMM (``[tile, H] @ [H, V]``) has few rows and a very wide output, the
    shape where MKL's sgemm falls furthest behind oneDNN's brgemm on some CPUs: on a 2-core
    AMD EPYC (Zen 4), ``[384, 1024] @ [1024, 128256]`` runs at ~155 GFLOP/s through
    ``aten.mm`` and ~190 through oneDNN, and a whole tile is 10-20% faster. oneDNN reads
    ``b`` in either layout without a copy. Anything but two non-empty float32 CPU matrices
    goes to aten.
    """
    matrices = a.dim() == b.dim() == 2 and a.numel() > 0 and b.numel() > 0 and a.device.type == "cpu"
    if matrices and a.dtype is torch.float32 and b.dtype is torch.float32:
        return _onednn_linear()(a, b.t(), bias, "none", [], "")
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _onednn_mm_transposed(
    a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`_onednn_mm` of ``a`` and ``b_t.t()``, given ``b_t``: where the graph transposed a
    tensor only to multiply by it, oneDNN's linear takes the tensor as it is (the same call, with
    the same strides, as :func:`_onednn_mm` makes). A tile's two float32 products are both of
    that form (the head ``W`` and its ``t(t(W))``): two to three dispatches of ``t`` fewer a tile."""
    matrices = a.dim() == b_t.dim() == 2 and a.numel() > 0 and b_t.numel() > 0 and a.device.type == "cpu"
    if matrices and a.dtype is torch.float32 and b_t.dtype is torch.float32:
        return _onednn_linear()(a, b_t, bias, "none", [], "")
    return torch.mm(a, b_t.t()) if bias is None else torch.addmm(bias, a, b_t.t())


def backward_products_on_onednn() -> bool:
    """Whether the hidden gradient (``[tile, V] @ [V, H]``) and a direct weight gradient go to
    oneDNN too: where the CPU has AVX-512. On an AVX2 Zen 3, MKL computes a 256-token hidden
    gradient 15-20% faster (52 against 61 ms at V=32000, H=512); on an AVX-512 Zen 4, oneDNN
    took 0.77 s against MKL's 1.47 for a 4096 x 32000, H=1024 batch's."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def run(root: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    """Replace the graph's out-of-place float32 ``mm`` (and ``addmm`` of a ``[V]`` bias) with
    :func:`_onednn_mm`: the logits GEMM (the first one met), and the others where
    :func:`backward_products_on_onednn`; the in-place weight-gradient ``addmm_`` stays aten's."""
    routed, gemms = 0, [(gm, node) for gm, node in graph_nodes(root) if node.target in GEMMS]
    for gm, node in gemms if backward_products_on_onednn() else gemms[:1]:
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args]
        if not vals or not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in vals):
            continue
        if node.target is aten.mm.default and not node.kwargs:
            args = node.args
        elif node.target is aten.addmm.default and not node.kwargs and len(vals) == 3 and vals[0].dim() == 1:
            args = (node.args[1], node.args[2], node.args[0])
        else:
            continue
        b = args[1]
        if isinstance(b, torch.fx.Node) and b.target is aten.t.default:
            replace_with_call(
                gm, node, "call_function", _onednn_mm_transposed, (args[0], b.args[0], *args[2:])
            )
            if not b.users:
                gm.graph.erase_node(b)
        else:
            replace_with_call(gm, node, "call_function", _onednn_mm, args)
        routed += 1
    recompile_all(root)
    log.debug("tile %s: %d GEMMs on oneDNN", key, routed)
    return root
