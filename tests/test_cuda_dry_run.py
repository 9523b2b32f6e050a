"""A CUDA dry run without a GPU: tile_pass's CUDA branches traced on fake ``cuda`` tensors.

Every CUDA branch of tile_pass (every token computed, no label check on the host, the tile
budget from free device memory, the weight-gradient sums without the CPU's C loops and shared
buffers, compiled tile middles without the CPU's row blocks) runs here on ``FakeTensorMode``
tensors whose device is ``cuda``: the Dynamo graph is matched and rewritten, the tile functions
are traced and differentiated by ``make_fx``, and the tile loops run end to end, with shapes,
dtypes and devices checked. Fake tensors hold no data, so any host synchronisation
(``.item()``, ``bool(tensor)``, ``nonzero``) raises: a clean run shows there is none, and a
``make_fx`` trace of the loops shows no ``_local_scalar_dense``/``nonzero`` and no tensor on
the CPU. Inductor is replaced by a recorder (it would generate Triton, which needs a GPU): the
compiled middles are checked as the graphs Inductor would be handed, not as kernels.

Why a child process: on a CPU-only build, autograd cannot differentiate fake ``cuda`` tensors.
Its engine asks for the CUDA device guard ("PyTorch is not linked with support for cuda
devices", a process abort) and for the current CUDA stream ("Cannot access accelerator device
when none is available"), and torch creates its CUDA hooks when it is imported. So the checks
run in one spawned process that loads a small C++ shim before torch: c10's own
``FakeGuardImpl<CUDA>`` as the CUDA device guard, and CUDA hooks that report CUDA present. The
shim is built here with the system C++ compiler against torch's headers (cached in the temp
directory); nothing in it computes, and ``torch.cuda.is_available()`` stays False in the child.
On a machine with a GPU the child runs without the shim.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# ------------------------------------------------------------------ the child process

_SHIM = r"""
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;

struct FakeCUDAHooks : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
};

// 1: installed; 0: a CUDA device guard exists (a CUDA build), nothing done; -1: the guard is
// set but torch had created its CUDA hooks already (the shim was loaded after torch)
int status = 0;

__attribute__((constructor)) void install() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() != nullptr) return;
  slot.store(&fake_cuda_guard);
  at::CUDAHooksRegistry()->Register(
      "CUDAHooks", [](at::CUDAHooksArgs args) -> std::unique_ptr<at::CUDAHooksInterface> {
        return std::make_unique<FakeCUDAHooks>(args);
      });
  status = at::hasCUDA() ? 1 : -1;
}
}  // namespace

extern "C" int tile_pass_fake_cuda_status() { return status; }
"""


def _shim_library() -> str:
    """The shim's shared library, built once per torch version and source (or a skip saying why not)."""
    if sys.platform != "linux":
        pytest.skip("the fake-CUDA shim is built for Linux only")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    if compiler is None:
        pytest.skip("no C++ compiler to build the fake-CUDA shim (set CXX)")
    if not (include / "ATen" / "detail" / "CUDAHooksInterface.h").exists():
        pytest.skip(f"torch's C++ headers are not installed under {include}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    digest = hashlib.sha256(f"{_SHIM}{torch.__version__}{torch_dir}{compiler}{abi}".encode()).hexdigest()[:16]
    built = Path(tempfile.gettempdir()) / f"tile_pass_fake_cuda_{digest}.so"
    if built.exists():
        return str(built)
    work = Path(tempfile.mkdtemp(prefix="tile_pass_fake_cuda_"))
    source, out = work / "shim.cpp", work / "shim.so"
    source.write_text(_SHIM)
    for standard in ("c++17", "c++20"):  # torch's headers need at least C++17
        command = [
            compiler, "-O1", f"-std={standard}", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{include}", str(source), "-o", str(out),
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as error:
            pytest.skip(f"could not build the fake-CUDA shim: {error}")
        if done.returncode == 0:
            break
    else:
        pytest.skip(f"could not build the fake-CUDA shim: {done.stderr.strip()[-600:]}")
    os.replace(out, built)  # atomic: a concurrent session sees the whole library or none
    shutil.rmtree(work, ignore_errors=True)
    return str(built)


class _Child:
    """One spawned process that runs the checks; restarted if a check kills it."""

    def __init__(self, shim: str):
        self.shim = shim
        self.pool = None

    def run(self, check, *args):
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                # the shim's constructor must run before torch is imported: the initializer is
                # ctypes' loader, unpickled and called before any check (or torch) is loaded
                initializer=ctypes.CDLL,
                initargs=(self.shim,),
            )
        try:
            return self.pool.submit(check, *args).result(timeout=300)
        except concurrent.futures.process.BrokenProcessPool:
            self.close()
            raise

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


@pytest.fixture(scope="module")
def child():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the CUDA tests run for real (scripts/cuda_check.sh)")
    if torch.backends.cuda.is_built():
        pytest.skip(
            "a CUDA build without a device: autograd of fake cuda tensors needs a device there, and "
            "this build's own CUDA hooks cannot be replaced"
        )
    runner = _Child(_shim_library())
    yield runner
    runner.close()


# ------------------------------------------------- what the child runs (helpers and checks)

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)

#: ops that read a device value on the host (or whose output size does)
_HOST_SYNCS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.nonzero.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.masked_select.default,
}


def _quiet():
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    warnings.filterwarnings("ignore", message="User provided device_type of 'cuda'")


def _modules():
    """tile_pass's modules, imported in the child ."""
    import importlib

    import tile_pass

    names = ("tiles._tile_kernel", "tiles._tile_passes", "plan._tiling", "plan._weight_grad",
             "tiles._split_planes", "tiles._split_sum_cpu", "tiles.tiled_region", "plan._plan")  # fmt: skip
    return tile_pass, {name.split(".")[-1]: importlib.import_module(f"tile_pass.{name}") for name in names}


def _need(args) -> list[bool]:
    """A region op's ``need`` flags for ``args`` (``(..., hidden, weight, bias, token_inputs,
    row_inputs)``): the hidden states, the weight and the bias where there is one."""
    _, _, bias, token_inputs, row_inputs = args[-5:]
    return [True, True, bias is not None] + [False] * (len(token_inputs) + len(row_inputs))


def _call(node):
    """The :class:`tile_pass.plan._plan.RegionCall` a rewritten graph's ``run_region`` node carries."""
    from tile_pass.plan._plan import RegionCall

    return RegionCall.parse(node.kwargs["call"])


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()  # no ShapeEnv: a data-dependent value raises


def _assert_fake_cuda(t, shape, dtype, what=""):
    from torch._subclasses.fake_tensor import is_fake

    assert isinstance(t, torch.Tensor) and is_fake(t), f"{what}: {type(t)} is not a fake tensor"
    assert t.device.type == "cuda", f"{what}: on {t.device}, not cuda"
    assert tuple(t.shape) == tuple(shape), f"{what}: shape {tuple(t.shape)}, expected {tuple(shape)}"
    assert t.dtype == dtype, f"{what}: dtype {t.dtype}, expected {dtype}"


def _assert_no_host_sync(gm: torch.fx.GraphModule, what: str) -> None:
    """No op of the trace reads a device value on the host, and no tensor of it is on the CPU (no
    copy to the host; ``meta`` tensors, which hold nothing, may be made to work out a dtype)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "placeholder"):
            continue
        assert node.target not in _HOST_SYNCS, f"{what}: host synchronisation {node.format_node()}"
        for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                where = value.device.type
                assert where in ("cuda", "meta"), f"{what}: {node.format_node()} makes a tensor on {where}"


@contextlib.contextmanager
def _patch_cuda_memory(free_bytes: int):
    """``torch.cuda`` as the tile budget reads it: available, with ``free_bytes`` free."""
    with (
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.mem_get_info", lambda device=None: (free_bytes, 2 * free_bytes)),
    ):
        yield


@contextlib.contextmanager
def _recorded_inductor():
    """Inductor replaced by a recorder of what it is handed (each graph runs as traced), and the
    tile graphs finished with fake example inputs (on a GPU those are real device tensors).
    Yields the ``(graph, example inputs)`` handed over; drops the stubbed kernels on exit."""
    tile_pass, m = _modules()
    handed = []

    def compile_fx(gm, example_inputs, *args, **kwargs):
        handed.append((gm, list(example_inputs)))
        return gm

    finish = m["_tile_passes"].finish_tile_graph
    from torch._subclasses.fake_tensor import FakeTensorMode

    def finish_with_fake_examples(gm, key, retrace=None):
        with FakeTensorMode(allow_non_fake_inputs=True):
            return finish(gm, key, retrace)

    patches = [mock.patch("torch._inductor.compile_fx.compile_fx", compile_fx)]
    patches += [
        mock.patch.object(m[name], "finish_tile_graph", finish_with_fake_examples)
        for name in ("_tile_passes", "tiled_region")
    ]
    tile_pass.clear_caches()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        try:
            yield handed
        finally:
            tile_pass.clear_caches()


def _assert_middles_for_cuda(handed, what):
    """Every graph handed to Inductor takes cuda inputs only, and no tile middle holds a GEMM."""
    assert handed, f"{what}: nothing was handed to Inductor"
    for gm, examples in handed:
        devices = {e.device.type for e in examples if isinstance(e, torch.Tensor)}
        assert devices == {"cuda"}, f"{what}: Inductor would compile for {devices}"
        gemms = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
        assert not gemms, f"{what}: a GEMM in a compiled middle: {gemms}"


def _check_premise(shim):
    """The child has the shim installed and no GPU, fake cuda tensors are differentiated, and a
    host synchronisation on them raises."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    _quiet()
    status = ctypes.CDLL(shim).tile_pass_fake_cuda_status()
    assert status == 1, f"fake-CUDA shim status {status} (-1: torch was imported before it)"
    assert not torch.cuda.is_available()
    with _fake_mode():
        x = torch.randn(4, 3, device="cuda").requires_grad_()
        (grad,) = torch.autograd.grad((x * x).sum(), x)
        assert grad.device.type == "cuda"
        for sync in (lambda: bool(x.sum() > 0), lambda: x.sum().item(), lambda: x.nonzero()):
            try:
                sync()
            except (DataDependentOutputException, DynamicOutputShapeException):
                continue
            raise AssertionError("a host synchronisation did not raise under FakeTensorMode")
    return "ok"


def _check_planning(dtype):
    """The budget is 1/16 of the free device memory within [256 MiB, 4 GiB]; the tile and the
    weight-gradient schedule follow from it as documented, unlike the CPU's fixed 128 MiB."""
    _quiet()
    _, m = _modules()
    tiling, weight_grad = m["_tiling"], m["_weight_grad"]
    with _patch_cuda_memory(8 << 30):
        assert tiling._free_gpu_memory(0) == 8 << 30
        assert tiling.default_tile_bytes("cuda") == (8 << 30) // 16
        assert tiling.default_tile_bytes("cuda:0") == (8 << 30) // 16
        assert tiling.default_tile_bytes("cpu") == tiling.DEFAULT_TILE_BYTES
    with _patch_cuda_memory(1 << 30):
        assert tiling.default_tile_bytes(torch.device("cuda", 0)) == tiling.GPU_MIN_TILE_BYTES
    with _patch_cuda_memory(1 << 40):
        assert tiling.default_tile_bytes("cuda") == tiling.GPU_MAX_TILE_BYTES
    assert tiling._free_gpu_memory(0) is None  # unpatched: no device here
    assert tiling.default_tile_bytes("cuda") == tiling.GPU_MIN_TILE_BYTES

    V, H, itemsize = 128256, 4096, dtype.itemsize
    for fused in (False, True):
        per_token = tiling.tile_bytes_per_token(V, dtype, dtype != torch.float32, fused)
        with _patch_cuda_memory(80 << 30):  # an 80 GiB device: the 4 GiB cap
            tile = tiling.choose_tile_tokens(V, dtype, dtype != torch.float32, device="cuda", fused=fused)
        assert tile == min(65536, (4 << 30) // per_token // 16 * 16), (fused, tile)
        cpu = tiling.choose_tile_tokens(V, dtype, dtype != torch.float32, device="cpu", fused=fused)
        assert cpu < tile
        # the tile loop's plan for the CUDA benchmark's batches
        for N in (8192, 16384):
            now = tiling.effective_tile(N, tiling.TileSize(tile, True))
            planned, schedule = weight_grad.plan(
                N, now, tiling.TileSize(tile, True), (V, H), dtype, torch.float32, per_token, N
            )
            assert schedule.value == ("float32" if dtype == torch.float32 else "split"), schedule
            assert planned % 64 == 0 and planned >= tiling.MIN_AUTO_TILE and -(-N // planned) >= 2
            if dtype == torch.bfloat16:  # at most half of the unfused step, where a tile >= 256 gets there
                bound = weight_grad.unfused_bytes(N, (V, H), itemsize, per_token) // 2
                held = [weight_grad.held_bytes(t, N, (V, H), itemsize, per_token) for t in (planned, 256)]
                assert held[0] <= bound or held[1] > bound, (N, fused, planned)
    return "ok"


@contextlib.contextmanager
def _implementations():
    """The custom ops' Python implementations in place of the ops, so that a rewritten graph run
    on fake tensors runs the tile loops (an op on fake tensors runs its fake kernel instead)."""
    _, m = _modules()
    ops = [("tiled_region", "_row_region_loss"), ("tiled_region", "_row_region"),
           ("tiled_region", "_row_region_backward")]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for module, name in ops:
            stack.enter_context(mock.patch.object(m[module], name, getattr(m[module], name)._init_fn))
        yield


@contextlib.contextmanager
def _recorded_implementations():
    """:func:`_implementations`, recording each call: ``(op name, args, kwargs, result)``."""
    _, m = _modules()
    region_op, calls = m["tiled_region"], []

    def recording(name, implementation):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs, implementation(*args, **kwargs)))
            return calls[-1][3]

        return call

    with _implementations():
        names = ("_row_region_loss", "_row_region")
        with contextlib.ExitStack() as stack:
            for name in names:
                stack.enter_context(
                    mock.patch.object(region_op, name, recording(name, getattr(region_op, name)))
                )
            yield calls


def _capture(fn, inputs, **options):
    """``fn`` compiled by tile_pass's backend on fake cuda inputs made from ``inputs`` (``(shape,
    dtype)`` for floating tensors that require grad, ``(shape, high)`` for class indices):
    ``(mode, inputs, fn's result, report, rewritten graph)``."""
    tile_pass, _ = _modules()
    torch._dynamo.reset()
    graphs = []
    backend = tile_pass.backend(lambda gm, example_inputs: graphs.append(gm) or gm.forward, **options)
    mode = _fake_mode()
    with mode:
        made = [
            torch.randn(shape, dtype=kind, device=CUDA, requires_grad=True)
            if isinstance(kind, torch.dtype)
            else torch.randint(0, kind, shape, device=CUDA)
            for shape, kind in inputs
        ]  # fmt: skip
    result = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*made)
    (gm,) = graphs
    return mode, made, result, backend.report(), gm


def _linear_ce(h, w, y):
    return F.cross_entropy(F.linear(h, w).float().view(-1, w.shape[0]), y.view(-1))


def _linear_ce_returning_logits(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits.float().view(-1, w.shape[0]), y.view(-1), reduction="sum"), logits


def _check_cross_entropy_rewrite(dtype, returns_logits):
    """Dynamo's graph on fake cuda inputs: the region is matched and rewritten, the report plans
    the tiles from the device's free memory (6 GiB: a 384 MiB budget, not the CPU's 128 MiB),
    forward and backward run on the fake device, and the rewritten graph runs its tile loop
    (compiled tiles, as Inductor would get them) with no host synchronisation."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _quiet()
    _, m = _modules()
    tiling, weight_grad = m["_tiling"], m["_weight_grad"]
    # batches where the budget, not the batch, bounds the tile: 8 tiles here, 16 on the CPU (a
    # small V keeps the weight-gradient product to one block per tile: each is a traced call here)
    B, T, H, V = (8 if dtype == torch.float32 else 16), 8192, 64, 8000
    N = B * T
    fn = _linear_ce_returning_logits if returns_logits else _linear_ce
    with mock.patch.object(tiling, "_free_gpu_memory", lambda device_index: 6 << 30):
        mode, (h, w, y), result, report, gm = _capture(fn, [((B, T, H), dtype), ((V, H), dtype), ((B, T), V)])
        budget = tiling.default_tile_bytes(CUDA)
    assert budget == 384 << 20
    loss, logits = result if returns_logits else (result, None)
    _assert_fake_cuda(loss, (), torch.float32, "loss")
    if returns_logits:
        _assert_fake_cuda(logits, (B, T, V), dtype, "returned logits")
    (graph,) = report.graphs
    assert not graph.skipped and len(graph.rewrites) == 1, str(report)
    (rewrite,) = graph.rewrites
    largest = tiling.choose_tile_tokens(V, dtype, True, tile_bytes=budget, fused=True)
    cpu = tiling.choose_tile_tokens(V, dtype, True, device="cpu", fused=True)
    on_cpu = tiling.effective_tile(N, tiling.TileSize(cpu, True))
    automatic = tiling.TileSize(largest, True)
    assert tiling.effective_tile(N, automatic) > on_cpu
    tile, schedule = weight_grad.plan(
        N, tiling.effective_tile(N, automatic), automatic, (V, H), dtype, torch.float32,
        tiling.tile_bytes_per_token(V, dtype, True, True), N,
    )  # fmt: skip
    assert schedule.value == ("float32" if dtype == torch.float32 else "split")
    assert (rewrite.dtype, rewrite.num_tokens, rewrite.compiled_tiles) == (str(dtype)[6:], N, True)
    assert (rewrite.tile_tokens, rewrite.num_tiles) == (tile, -(-N // tile)), str(rewrite)
    text = "float32 sum in two 16-bit planes" if schedule.value == "split" else "float32 sum"
    assert rewrite.weight_grad_sum.startswith(text), rewrite.weight_grad_sum
    if returns_logits:
        assert rewrite.returned_logits.startswith("returned exactly, written by the tiles"), rewrite
    calls = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "run_region"]
    assert len(calls) == 1 and _call(calls[0]).compile_tiles is True
    assert _call(calls[0]).tile == tiling.TileSize(largest, True)

    with mode:
        loss.backward()  # the op's backward (the chain rule for a scalar) on the fake device
    _assert_fake_cuda(h.grad, (B, T, H), dtype, "hidden gradient")
    _assert_fake_cuda(w.grad, (V, H), dtype, "weight gradient")

    with _recorded_inductor() as handed, _implementations(), mode, m["_plan"].recorded() as plans:
        # the rewritten graph with its tile loop, run (and traced) on the fake device
        traced = make_fx(gm, tracing_mode="fake")(h, w, y)
    ran = plans[-1]
    assert (ran.rows, ran.tile, ran.num_tiles) == (
        N,
        tile,
        -(-N // tile),
    )  # every token: no skipping on a GPU
    assert ran.schedule == schedule
    out = [n.meta["val"] for n in next(n for n in traced.graph.nodes if n.op == "output").args[0]]
    _assert_fake_cuda(out[0], (), torch.float32, "loss from the tile loop")
    if returns_logits:
        _assert_fake_cuda(out[1], (B, T, V), dtype, "logits written by the tiles")
    _assert_no_host_sync(traced, "rewritten graph")
    _assert_middles_for_cuda(handed, "rewritten graph")
    return "ok"


def _z_loss(h, w, y):
    logits = F.linear(h, w).float()
    ce = F.cross_entropy(logits.view(-1, w.shape[0]), y.view(-1))
    return ce + 1e-4 * logits.logsumexp(-1).pow(2).mean()


def _token_log_probs(h, w, ids):
    return F.linear(h, w).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _check_row_region_rewrite(dtype, form, compiled):
    """A row-wise region (z-loss: one scalar loss; per-token log-probabilities: returned rows) on
    fake cuda inputs: matched, rewritten and planned for the device, run through its tile loop
    (``row_region_loss``/``row_region``, then ``row_region_backward``) with no host sync; the
    program's tile functions are traced for cuda."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _quiet()
    _, m = _modules()
    tiling, region_op = m["_tiling"], m["tiled_region"]
    B, T, H, V = 2, 2048, 64, 8000  # a V where the device budget and the CPU's give other tiles
    N = B * T
    fn = _z_loss if form == "z_loss" else _token_log_probs
    with mock.patch.object(tiling, "_free_gpu_memory", lambda device_index: 8 << 30):
        mode, (h, w, y), result, report, gm = _capture(
            fn, [((B, T, H), dtype), ((V, H), dtype), ((B, T), V)], compile_tiles=compiled
        )
    (graph,) = report.graphs
    assert not graph.skipped and len(graph.rewrites) == 1, str(report)
    (rewrite,) = graph.rewrites
    upcast = dtype != torch.float32
    largest = tiling.choose_tile_tokens(V, dtype, upcast, tile_bytes=512 << 20, fused=compiled)
    tile = tiling.effective_tile(N, tiling.TileSize(largest, True))
    assert (rewrite.tile_tokens, rewrite.compiled_tiles) == (tile, compiled), str(rewrite)
    (call,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "run_region"]
    cpu = tiling.choose_tile_tokens(V, dtype, upcast, device="cpu", fused=compiled)
    assert _call(call).tile == tiling.TileSize(largest, True) != tiling.TileSize(cpu, True), call.kwargs
    schedule = "two 16-bit planes" if dtype == torch.bfloat16 else "float32 sum ("
    assert schedule in rewrite.weight_grad_sum, rewrite.weight_grad_sum
    with mode:
        if form == "z_loss":
            _assert_fake_cuda(result, (), torch.float32, "z-loss")
            result.backward()
        else:
            _assert_fake_cuda(result, (B, T), dtype, "log-probabilities")
            result.sum().backward()  # row_region's vjp: row_region_backward, here its fake kernel
    _assert_fake_cuda(h.grad, (B, T, H), dtype, "hidden gradient")
    _assert_fake_cuda(w.grad, (V, H), dtype, "weight gradient")

    keys, calls = [], []
    program_kernel, row_region = region_op._program_kernel, region_op._row_region._init_fn

    def spy_kernel(key):
        keys.append(key)
        return program_kernel(key)

    def spy_region(*args, **kwargs):
        calls.append((args, kwargs))
        return row_region(*args, **kwargs)

    context = _recorded_inductor() if compiled else contextlib.nullcontext([])
    spies = mock.patch.object(region_op, "_program_kernel", spy_kernel)
    with context as handed, _implementations(), spies, mode:
        with mock.patch.object(region_op, "_row_region", spy_region):
            out = gm(h, w, y)
        if form == "z_loss":
            _assert_fake_cuda(out[0], (), torch.float32, "z-loss from the tile loop")
        else:
            _assert_fake_cuda(out[0], (B, T), dtype, "log-probabilities from the tile loop")
            ((args, kwargs),) = calls
            hidden, weight, bias, token_inputs, row_inputs = args
            tangents = [torch.ones(N, dtype=dtype, device=CUDA)]
            grads = region_op._row_region_backward(  # its implementation, by _implementations
                tangents, hidden, weight, bias, token_inputs, row_inputs, **kwargs, need=_need(args)
            )
            _assert_fake_cuda(grads[0], (N, H), dtype, "row_region_backward: hidden gradient")
            _assert_fake_cuda(grads[1], (V, H), dtype, "row_region_backward: weight gradient")
        traced = make_fx(gm, tracing_mode="fake")(h, w, y)
    _assert_no_host_sync(traced, f"{form} region")
    if compiled:
        _assert_middles_for_cuda(handed, f"{form} region")
    assert keys and {k.device.type for k in keys} == {"cuda"}
    assert not any(k.onednn for k in keys) and {k.compiled for k in keys} == {compiled}
    differentiated = [k for k in keys if k.need_weight]
    assert differentiated, "no tile function formed the weight gradient"
    assert {k.weight_grad.value for k in differentiated} == {
        "split" if dtype == torch.bfloat16 else "float32"
    }
    return "ok"


def _linear_ce_bias_returning_logits(h, w, b, y):
    logits = F.linear(h, w, b)
    return F.cross_entropy(logits.float().view(-1, w.shape[0]), y.view(-1), reduction="sum"), logits


_PROGRAMS: dict[tuple, object] = {}  # the programs, held


def _captured_program(fn, inputs) -> str:
    """The program of ``fn``'s region, registered by a rewrite on fake cuda inputs (once)."""
    key = (fn.__name__, *inputs)
    if key not in _PROGRAMS:
        with mock.patch.object(_modules()[1]["_tiling"], "_free_gpu_memory", lambda device_index: 6 << 30):
            gm = _capture(fn, inputs)[4]
        (call,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "run_region"]
        from tile_pass.program import _region

        # held here, as a compiled graph holds it: the registry finds it after a clear_caches
        _PROGRAMS[key] = _region.lookup(_call(call).program)
    return _PROGRAMS[key].key


def _fake_inputs(spec, vocab_size, make):
    """A tile's inputs on the fake device, as its named spec gives them: indices below
    ``vocab_size``, 16-bit planes zeroed, the rest from ``make``."""

    def fake(leaf):
        if leaf is None:
            return None
        if leaf.dtype == torch.int64:
            return torch.randint(0, vocab_size, leaf.shape, device=CUDA)
        if leaf.dtype == torch.int16:
            return torch.zeros(leaf.shape, dtype=leaf.dtype, device=CUDA)
        return make(leaf.shape, dtype=leaf.dtype, device=CUDA)

    return torch.utils._pytree.tree_map(fake, spec)


def _check_tile_kernel(dtype, schedule, variant, compiled):
    """The cross entropy's tile function for a cuda key: traced and differentiated by make_fx on
    fake cuda tensors, finished without the CPU's rewrites (shared logits buffer, oneDNN GEMMs,
    huge-page GEMM outputs, row-blocked middles, C loops for the split sum), and run on fake cuda
    inputs."""
    _quiet()
    _, m = _modules()
    region_op = m["tiled_region"]
    from tile_pass.program import _region
    from tile_pass.tiles import _tile_buffers
    from tile_pass.tiles._tile_passes import compiled_middle, onednn_gemms, split_accumulation

    T, H, V = 96, 64, 1000
    bias = variant == "bias+logits"
    if bias:
        fn, inputs = _linear_ce_bias_returning_logits, [((2, 48, H), dtype), ((V, H), dtype), ((V,), dtype)]
    else:
        fn, inputs = _linear_ce, [((2, 48, H), dtype), ((V, H), dtype)]
    program = _region.lookup(_captured_program(fn, [*inputs, ((2, 48), V)]))
    key = m["_tile_kernel"].TileKernelKey(
        program=program.key, tile=T, hidden_size=H, vocab_size=V, hidden_dtype=dtype, weight_dtype=dtype,
        bias_dtype=dtype if bias else None, token_inputs=(((), torch.int64),), row_inputs=(),
        tangents=tuple(i for i, out in enumerate(program.outputs) if out.differentiable), device=CUDA,
        need_hidden=True, need_weight=True, need_bias=bias, acc_dtype=torch.float32, compiled=compiled,
        onednn=onednn_gemms.onednn_gemms_apply(CUDA),
        weight_grad=m["_weight_grad"].WeightGradSchedule("float32" if schedule == "sum" else schedule),
    )  # fmt: skip
    assert key.onednn is False
    context = _recorded_inductor() if compiled else contextlib.nullcontext([])
    with context as handed:
        kernel = region_op._program_kernel(key)
        graphs = [g for g in kernel.modules() if isinstance(g, torch.fx.GraphModule)]
        targets = {n.target for g in graphs for n in g.graph.nodes}
        cpu_only = {_tile_buffers.mm, _tile_buffers.addmm, _tile_buffers.fresh_mm, onednn_gemms._onednn_mm,
                    onednn_gemms._onednn_mm_transposed}  # fmt: skip
        assert not targets & cpu_only, targets & cpu_only
        modules = list(kernel.modules())
        assert not any(isinstance(g, compiled_middle._RowBlocked) for g in modules)
        for g in graphs[:1]:
            for n in g.graph.nodes:
                if n.op == "placeholder":
                    assert n.meta["val"].device.type == "cuda", n.format_node()
        if schedule == "sum" and dtype == torch.float32:
            assert aten.addmm_.default in targets  # the weight gradient summed in place
        blocked = [g for g in modules if isinstance(g, split_accumulation._BlockedSplitAccumulate)]
        assert bool(blocked) == (schedule == "split")
        for g in blocked:  # no C loop (store, add-and-round, add) on the GPU; the add is compiled or eager
            assert g.store is None and g.add_and_round is None and (g.add is not None) == compiled
            for add in g.add.adds.values() if compiled else ():
                assert "_checked" not in add.__qualname__, "a CPU C loop adds into cuda planes"
        if compiled:
            assert type(kernel.submod_1).__name__ == "Compiled"
            _assert_middles_for_cuda(handed, "tile middle")
        with _fake_mode():
            inputs = _fake_inputs(region_op._input_spec(key, program), V, torch.zeros)
            if schedule == "split":  # the planes of a fresh sum, as the tile loop makes them
                inputs = inputs._replace(weight_grad_sum=m["_split_planes"].unwritten_planes((V, H), CUDA))
            result = list(kernel(*inputs.flat()))
            for out in program.outputs:
                value = result.pop(0)
                _assert_fake_cuda(value, (T, *_region.row_part(out.layout, V)), out.dtype, f"output {out}")
            _assert_fake_cuda(result.pop(0), (T, H), dtype, "hidden gradient")
            if schedule == "direct":
                _assert_fake_cuda(result.pop(0), (V, H), dtype, "weight gradient of the only tile")
            assert not result
    return "ok"


_Z_LOSS_PROGRAMS: dict[torch.dtype, str] = {}


def _capture_z_loss_program(dtype):
    """The z-loss region's program, registered by a rewrite on fake cuda inputs (once per dtype)."""
    if dtype not in _Z_LOSS_PROGRAMS:
        gm = _capture(_z_loss, [((2, 64, 32), dtype), ((300, 32), dtype), ((2, 64), 300)])[4]
        (call,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "run_region"]
        _Z_LOSS_PROGRAMS[dtype] = _call(call).program
    return _Z_LOSS_PROGRAMS[dtype]


def _check_program_kernel(dtype, compiled):
    """``tiled_region._program_kernel`` for a cuda key: the region's row program traced and
    differentiated on fake cuda tensors, and run on fake cuda inputs."""
    _quiet()
    _, m = _modules()
    region_op = m["tiled_region"]
    from tile_pass.program import _region

    program = _region.lookup(_capture_z_loss_program(dtype))
    T, H = 64, 32
    split = dtype == torch.bfloat16
    schedule = m["_weight_grad"].WeightGradSchedule
    key = m["_tile_kernel"].TileKernelKey(
        program=program.key, tile=T, hidden_size=H, vocab_size=program.vocab_size, hidden_dtype=dtype,
        weight_dtype=dtype, bias_dtype=None, token_inputs=(((), torch.int64),) * len(program.token_layouts),
        row_inputs=(), tangents=tuple(i for i, out in enumerate(program.outputs) if out.differentiable),
        device=CUDA, need_hidden=True, need_weight=True, need_bias=False, acc_dtype=torch.float32,
        compiled=compiled, onednn=m["_tile_passes"].onednn_gemms.onednn_gemms_apply(CUDA),
        weight_grad=schedule.SPLIT if split else schedule.FLOAT32,
    )  # fmt: skip
    context = _recorded_inductor() if compiled else contextlib.nullcontext([])
    with context as handed:
        kernel = region_op._program_kernel(key)
        if compiled:
            _assert_middles_for_cuda(handed, "row program middle")
        with _fake_mode():
            inputs = _fake_inputs(region_op._input_spec(key, program), program.vocab_size, torch.randn)
            if split:  # the planes of a fresh sum, as the tile loop makes them
                planes = m["_split_planes"].unwritten_planes((program.vocab_size, H), CUDA)
                inputs = inputs._replace(weight_grad_sum=planes)
            result = list(kernel(*inputs.flat()))
        assert len(result) == len(program.outputs) + 1
        for out, value in zip(program.outputs, result, strict=False):
            part = _region.row_part(out.layout, program.vocab_size)
            _assert_fake_cuda(value, (T, *part), out.dtype, f"program output {out}")
        _assert_fake_cuda(result[-1], (T, H), dtype, "hidden gradient")
    return "ok"


def _loop_inputs(N, H, V, dtype, bias=False, class_weights=False):
    h = torch.randn(N, H, dtype=dtype, device=CUDA, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, device=CUDA, requires_grad=True)
    b = torch.randn(V, dtype=dtype, device=CUDA, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,), device=CUDA)  # values unknown: the loop cannot skip or check labels
    class_weights = torch.rand(V, device=CUDA) if class_weights else None
    return h, w, b, y, class_weights


def _check_tile_loops(dtype, reduction, compiled):
    """``tile_pass.linear_cross_entropy`` (its region's tile loop, the custom ops'
    implementations) on fake cuda inputs for each reduction, with a bias, class weights and label
    smoothing: every result on the device with its shape and dtype, every token in the tiles
    (no label is read on the device: a fake tensor would raise), a short last tile, and the
    gradients."""
    tile_pass, m = _modules()
    _quiet()
    N, H, V = 300, 64, 1000
    label_smoothing = 0.1 if reduction == "mean" else 0.0
    context = _recorded_inductor() if compiled else contextlib.nullcontext([])
    recorded = m["_plan"].recorded()
    memory = _patch_cuda_memory(6 << 30)
    with context as handed, _recorded_implementations() as calls, memory, _fake_mode(), recorded as plans:
        for bias, class_weights in ((False, False), (True, reduction != "none")):
            calls.clear()
            h, w, b, y, cw = _loop_inputs(N, H, V, dtype, bias=bias, class_weights=class_weights)
            loss = tile_pass.linear_cross_entropy(
                h, w, y, linear_bias=b, weight=cw, reduction=reduction, label_smoothing=label_smoothing,
                tile_tokens=128, compile_tiles=compiled,
            )  # fmt: skip
            _assert_fake_cuda(loss, (N,) if reduction == "none" else (), torch.float32, "loss")
            ran = plans[-1]  # tiles of 128: two and one of 44 rows
            assert (ran.rows, ran.num_tiles, ran.tile) == (N, 3, 128), ran
            schedule = ran.schedule
            ((name, args, kwargs, result),) = calls
            leaves = [t for t in (h, w, b) if t is not None]
            if reduction == "none":  # the vector-Jacobian product re-runs the tiles
                assert name == "_row_region"
                grads = m["tiled_region"]._row_region_backward(
                    [torch.ones(N, device=CUDA)], *args, **kwargs, need=_need(args)
                )
            else:  # the gradients at unit upstream gradient, formed in forward
                assert name == "_row_region_loss" and kwargs["need"][2] == (b is not None)
                assert schedule.value == ("split" if dtype == torch.bfloat16 else "float32"), schedule
                grads = result[1:4]
            for grad, leaf, what in zip(grads, leaves, ("hidden", "weight", "bias"), strict=False):
                _assert_fake_cuda(grad, leaf.shape, dtype, f"{what} gradient")
    if compiled:
        _assert_middles_for_cuda(handed, "tile loop")
    return "ok"


def _check_tile_loop_plan(dtype):
    """A 128k-vocabulary step (N=8192) on an 80 GiB device: the budget is capped at 4 GiB, and
    the loop runs the tile and the weight-gradient schedule that ``_weight_grad.plan`` gives
    (``_check_planning`` plans the benchmark's H=4096; a narrow H keeps the fake blocks few)."""
    tile_pass, m = _modules()
    _quiet()
    tiling, weight_grad = m["_tiling"], m["_weight_grad"]
    N, H, V = 8192, 8, 128256
    upcast = dtype != torch.float32
    with _patch_cuda_memory(80 << 30):
        largest = tiling.choose_tile_tokens(V, dtype, upcast, device="cuda", fused=True)
    per_token = tiling.tile_bytes_per_token(V, dtype, upcast, True)
    assert largest == (4 << 30) // per_token // 16 * 16
    now = tiling.effective_tile(N, tiling.TileSize(largest, True))
    tile, schedule = weight_grad.plan(
        N, now, tiling.TileSize(largest, True), (V, H), dtype, torch.float32, per_token, N
    )
    assert schedule.value == ("split" if upcast else "float32")
    memory = _patch_cuda_memory(80 << 30)
    recorded = m["_plan"].recorded()
    implementations = _recorded_implementations()
    with _recorded_inductor() as handed, implementations as calls, memory, _fake_mode(), recorded as plans:
        h, w, _, y, _ = _loop_inputs(N, H, V, dtype)
        loss = tile_pass.linear_cross_entropy(h, w, y, compile_tiles=True)
        _assert_fake_cuda(loss, (), torch.float32, "loss")
        ((_, _, _, result),) = calls
        _assert_fake_cuda(result[1], (N, H), dtype, "hidden gradient")
        _assert_fake_cuda(result[2], (V, H), dtype, "weight gradient")
    ran = plans[-1]
    assert (ran.rows, ran.num_tiles, ran.tile, ran.schedule) == (N, -(-N // tile), tile, schedule), (
        ran,
        tile,
    )
    _assert_middles_for_cuda(handed, "128k-vocabulary step")
    return "ok"


def _check_traced_loops(dtype, compiled):
    """make_fx of the region ops ``tile_pass.linear_cross_entropy`` calls, run as their
    implementations (mean with a bias and label smoothing, the split sum for bfloat16; per-token
    losses and their vector-Jacobian product) on fake cuda inputs: no op syncs with the host, and
    no tensor is made or copied on the CPU."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tile_pass, _ = _modules()
    _quiet()
    N, H, V = 300, 64, 1000

    region_op = _modules()[1]["tiled_region"]

    def calls_to_trace(name, args, kwargs, mode):
        implementation = getattr(region_op, name)
        yield name, lambda *a: implementation(*a, **kwargs), args
        if name == "_row_region":  # and its vector-Jacobian product
            with mode:
                tangents = [torch.ones(N, device=CUDA)]
            backward = region_op._row_region_backward
            need = _need(args)
            yield (
                "_row_region_backward",
                lambda t, *a: backward(t, *a, **kwargs, need=need),
                (tangents, *args),
            )

    context = _recorded_inductor() if compiled else contextlib.nullcontext([])
    with context, _recorded_implementations() as calls, _patch_cuda_memory(6 << 30):
        for reduction in ("mean", "none"):
            calls.clear()
            mode = _fake_mode()
            with mode:  # the call the functional API makes: its region op and arguments
                h, w, b, y, _ = _loop_inputs(N, H, V, dtype, bias=True)
                smoothing = 0.1 if reduction == "mean" else 0.0
                tile_pass.linear_cross_entropy(
                    h, w, y, linear_bias=b, reduction=reduction, label_smoothing=smoothing, tile_tokens=128,
                    compile_tiles=compiled,
                )  # fmt: skip
            ((name, args, kwargs, _),) = calls
            for what, fn, fn_args in calls_to_trace(name, args, kwargs, mode):
                traced = make_fx(fn, tracing_mode="fake")(*fn_args)
                gemm_ops = (aten.mm.default, aten.addmm.default, aten.addmm_.default)
                gemms = [n for n in traced.graph.nodes if n.target in gemm_ops]
                assert len(gemms) >= 3, f"{what}: the tiles were not traced"
                _assert_no_host_sync(traced, what)
    return "ok"


def _check_vocab_parallel(dtype):
    """A vocabulary-sharded head on a one-rank gloo group and a cuda device mesh: the DTensor front
    door runs its sharded textbook region on fake cuda tensors (the op's fake kernel, then the
    one tile loop), and a make_fx trace of that loop has its collectives and no host sync."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.fx.experimental.proxy_tensor import make_fx

    _quiet()
    tile_pass, m = _modules()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", [0])
        H, V = 64, 1000
        mode = _fake_mode()
        with mode:
            h = torch.randn(3, 100, H, dtype=dtype, device=CUDA, requires_grad=True)
            w = torch.randn(V, H, dtype=dtype, device=CUDA, requires_grad=True)
            y = torch.randint(0, V, (3, 100), device=CUDA)
            head = DTensor.from_local(w, mesh, [Shard(0)], run_check=False)
            loss = tile_pass.linear_cross_entropy(h, head, y, label_smoothing=0.1)
            _assert_fake_cuda(loss, (), torch.float32, "sharded loss (fake kernel)")
            loss.backward()
            _assert_fake_cuda(h.grad, (3, 100, H), dtype, "hidden gradient")
            _assert_fake_cuda(w.grad, (V, H), dtype, "weight shard gradient")
        with _recorded_implementations() as calls:
            with mode:
                for reduction in ("mean", "sum"):
                    loss = tile_pass.linear_cross_entropy(
                        h, head, y, reduction=reduction, label_smoothing=0.1, tile_tokens=128
                    )
                    _assert_fake_cuda(loss, (), torch.float32, f"sharded {reduction} loss (tile loop)")
        (name, args, kwargs, _), _ = calls
        assert name == "_row_region_loss", name
        implementation = m["tiled_region"]._row_region_loss._init_fn  # the loop, not the op
        traced = make_fx(lambda *a: implementation(*a, **kwargs), tracing_mode="fake")(*args)
        names = [str(n.target).replace("allreduce", "all_reduce") for n in traced.graph.nodes]
        # 3 tiles with 4 functional all-reduces each (max, sum of exponentials, target logit, mean
        # logit), then the in-place one of the hidden gradient
        assert sum("_c10d_functional.all_reduce" in name for name in names) >= 3 * 4, names
        assert sum(name.startswith("c10d.all_reduce") for name in names) == 1, names
        _assert_no_host_sync(traced, "sharded tile loop")
    finally:
        if created:
            dist.destroy_process_group()
    return "ok"


# ------------------------------------------------------------------------------ the tests


def test_the_child_differentiates_fake_cuda_tensors_and_a_host_sync_raises(child):
    assert child.run(_check_premise, child.shim) == "ok"


@DTYPES
def test_tile_budget_and_plan_from_free_device_memory(child, dtype):
    assert child.run(_check_planning, dtype) == "ok"


@DTYPES
@pytest.mark.parametrize("returns_logits", [False, True], ids=["loss", "loss+logits"])
def test_cross_entropy_graph_on_cuda_is_rewritten_and_runs_its_tiles(child, dtype, returns_logits):
    assert child.run(_check_cross_entropy_rewrite, dtype, returns_logits) == "ok"


@DTYPES
@pytest.mark.parametrize(
    "form, compiled",
    [("z_loss", False), ("z_loss", True), ("token_log_probs", False)],
    ids=["z_loss-eager_tiles", "z_loss-compiled_tiles", "token_log_probs-eager_tiles"],
)
def test_row_region_on_cuda_is_rewritten_and_runs_its_tiles(child, dtype, form, compiled):
    assert child.run(_check_row_region_rewrite, dtype, form, compiled) == "ok"


@pytest.mark.parametrize(
    "dtype, schedule",
    [(torch.float32, "sum"), (torch.bfloat16, "split"), (torch.bfloat16, "direct"), (torch.bfloat16, "sum")],
    ids=["fp32-sum", "bf16-split", "bf16-direct", "bf16-sum"],
)
@pytest.mark.parametrize("variant", ["plain", "bias+logits"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_tiles", "compiled_tiles"])
def test_tile_kernel_is_traced_and_differentiated_for_cuda(child, dtype, schedule, variant, compiled):
    assert child.run(_check_tile_kernel, dtype, schedule, variant, compiled) == "ok"


@DTYPES
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_tiles", "compiled_tiles"])
def test_row_program_kernel_is_traced_and_differentiated_for_cuda(child, dtype, compiled):
    assert child.run(_check_program_kernel, dtype, compiled) == "ok"


@DTYPES
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_tile_loops_run_on_fake_cuda(child, dtype, reduction):
    # eager tiles; compiled ones run in the rewritten graphs, the 80 GiB step and the traced loops
    assert child.run(_check_tile_loops, dtype, reduction, False) == "ok"


@DTYPES
def test_tile_loop_runs_the_plan_for_an_80_gib_device(child, dtype):
    assert child.run(_check_tile_loop_plan, dtype) == "ok"


@DTYPES
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_tiles", "compiled_tiles"])
def test_traced_tile_loops_never_synchronise_with_the_host(child, dtype, compiled):
    assert child.run(_check_traced_loops, dtype, compiled) == "ok"


@DTYPES
def test_vocabulary_sharded_head_on_fake_cuda(child, dtype):
    assert child.run(_check_vocab_parallel, dtype) == "ok"
