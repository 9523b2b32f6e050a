"""What the pass did: one record per candidate region, readable as text or as a dict.

The driver (:mod:`tile_pass.rewrite`) decides; a rewritten region's record is filled from the
matched region and its tile plan by :func:`tile_pass._rewrite_record.rewrite_record`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

#: The ``[N, V]`` tensors an unfused cross entropy step makes (eager, ``aot_eager``) that the tiles
#: replace, by key of :attr:`Rewrite.logits_bytes`; ``forward_bytes_avoided`` sums the first three,
#: ``backward_bytes_avoided`` the next two; the last counts in the unfused step's peak alone.
LOGITS_TENSORS = {
    "logits": "logits",
    "float32_upcast": "float32 upcast",
    "saved_log_probs": "saved log-probabilities",
    "logits_grad": "logits gradient",
    "logits_grad_cast": "its cast to the model dtype",
    "loss_grad": "the loss's gradient (nll_loss's for a cross entropy)",
}
_FORWARD, _BACKWARD = ("logits", "float32_upcast", "saved_log_probs"), ("logits_grad", "logits_grad_cast")


def logits_bytes_fields(
    elements, itemsize: int, kept, tile_buffer: int, plain, *, backward: bool = True, grad_buffer=0
) -> dict[str, Any]:
    """The byte figures of a :class:`Rewrite` whose logits have ``elements`` elements of
    ``itemsize`` bytes (``kept``: bytes of them the graph returns, ``tile_buffer``: the bytes of
    ``[tile, V]`` buffers the tiles hold at a time; ``plain`` turns a symbolic size into its
    report form). The model is the cross entropy's (a row-wise program of other ops makes
    others): every float32 tensor is float64 for a float64 model. Without a ``backward`` (no
    output needs a gradient: ``torch.no_grad()``, a reference model's log-probabilities) no
    gradient exists to avoid, and an unfused step peaks in forward instead. ``grad_buffer``: the
    gradients the tiles form while their buffers live (the weight's sum, the hidden states'),
    which an unfused backward forms only after its peak, so they count against the unfused drop."""
    wide = 8 if itemsize == 8 else 4  # what the loss computes in
    half = itemsize < 4
    tensors = {
        "logits": elements * itemsize,
        "float32_upcast": elements * 4 if half else 0,
        "saved_log_probs": elements * wide,
        "loss_grad": elements * wide if backward else 0,
        "logits_grad": elements * wide if backward else 0,
        "logits_grad_cast": elements * itemsize if half and backward else 0,
    }
    # at eager's peak (in backward, _log_softmax_backward_data): its inputs, the saved
    # log-probabilities and the loss's gradient, and its output, the logits gradient; with no
    # backward, at log_softmax: its input (the float32 upcast, or the logits when that is no
    # copy) and its output, the log-probabilities
    unfused = tensors["saved_log_probs"] + tensors["loss_grad"] + tensors["logits_grad"]
    if not backward:
        unfused = (tensors["float32_upcast"] or tensors["logits"]) + tensors["saved_log_probs"]
    return {
        "forward_bytes_avoided": plain(
            tensors["logits"] + tensors["float32_upcast"] + tensors["saved_log_probs"] - kept
        ),
        "backward_bytes_avoided": plain(tensors["logits_grad"] + tensors["logits_grad_cast"]),
        "logits_bytes": {key: plain(value) for key, value in tensors.items()},
        "tile_buffer_bytes": plain(tile_buffer),
        "grad_buffer_bytes": plain(grad_buffer if backward else 0),
        # Inductor fuses the loss into one [N, V] buffer in the model dtype: the logits, their
        # gradient stored over them (measured without returned logits, which it cannot overwrite)
        "peak_bytes_avoided": {
            "unfused": plain(unfused - tile_buffer - (grad_buffer if backward else 0)),
            "inductor": plain(tensors["logits"] - tile_buffer),
        },
    }


@dataclass
class Rewrite:
    """A region replaced by the tiled loss.

    The bytes: ``logits_bytes`` names each ``[N, V]`` tensor an unfused step makes that the
    tiles replace (:data:`LOGITS_TENSORS`); ``forward_bytes_avoided`` is the logits, their
    float32 upcast and the saved log-probabilities, less the logits the graph returns
    (``returned_logits_bytes``, kept); ``backward_bytes_avoided`` the logits gradient (float32,
    and its cast to a half-precision model dtype). ``tile_buffer_bytes``: the ``[tile, V]``
    buffers the tiles hold at a time instead. ``peak_bytes_avoided`` is what a step's measured
    peak should drop by against the same step compiled without tile_pass: ``"unfused"`` with an
    inner compiler that runs the ops as they are (eager, aot_eager: their backward holds the
    saved log-probabilities, the loss's gradient and the logits gradient at once, less the
    tiles' buffers and ``grad_buffer_bytes``; ``tests/test_memory.py`` measures it),
    ``"inductor"`` with Inductor, which fuses the loss and holds one model-dtype ``[N, V]``
    buffer, less the tiles' buffers (measured within 0.1% in float32 and 8% in bfloat16, where
    tile_pass's float32 weight-gradient sum is the rest, at N=4096, V=32000, H=256, without returned logits).
    """

    graph: int
    matmul_source: str
    loss_source: str
    form: str
    num_tokens: int | str
    hidden_size: int | str
    vocab_size: int | str
    dtype: str
    reduction: str
    tile_tokens: int
    num_tiles: int | str
    forward_bytes_avoided: int | str
    backward_bytes_avoided: int | str
    returned_logits: str = "not returned"
    returned_logits_bytes: int | str = 0
    compiled_tiles: bool = False  # each tile's softmax/loss/gradient compiled by Inductor
    #: how the weight gradient is summed across tiles and the bytes it holds at the end of the
    #: loop: "float32 sum (4 bytes per weight)", "split float32 sum (...)", or "none"
    weight_grad_sum: str = "none"
    #: which tokens the tiles may leave out, or why every token runs
    token_skipping: str = ""
    #: bytes of each [N, V] tensor an unfused step makes (keys: LOGITS_TENSORS)
    logits_bytes: dict[str, int | str] = field(default_factory=dict)
    tile_buffer_bytes: int | str = 0
    #: the gradients the tiles form during the loop (weight-gradient sum, hidden states'), alive at
    #: the tiled step's peak where an unfused step forms them after its own
    grad_buffer_bytes: int | str = 0
    #: what the step's peak should drop by: {"unfused": ..., "inductor": ...} (see above)
    peak_bytes_avoided: dict[str, int | str] = field(default_factory=dict)
    #: whether a backward runs through the region (False when no output needs a gradient, as
    #: under ``torch.no_grad()``): the report then claims nothing of gradients
    backward: bool = True
    #: the ops of the region whose ``[N, V]`` input gradient an unfused backward makes beside
    #: the saved log-probabilities (``nll_loss`` for a cross entropy; ``gather`` for a
    #: hand-written one), for ``loss_grad``'s name
    loss_grad_ops: str = "nll_loss"

    def __str__(self) -> str:
        return (
            f"[graph {self.graph}] REWRITTEN {self.form}\n"
            f"    matmul: {self.matmul_source}\n"
            f"    loss:   {self.loss_source}\n"
            f"    N={self.num_tokens} H={self.hidden_size} V={self.vocab_size} {self.dtype}, "
            f"reduction={self.reduction}, tile={self.tile_tokens} tokens x {self.num_tiles} tiles"
            f" ({'compiled' if self.compiled_tiles else 'eager'} tiles)\n"
            + (f"    weight gradient: {self.weight_grad_sum}\n" if self.weight_grad_sum != "none" else "")
            + (f"    token skipping: {self.token_skipping}\n" if self.token_skipping else "")
            + (
                self._bytes_text()
                or f"    logits avoided: {_fmt_bytes(self.forward_bytes_avoided)} in forward, "
                + (
                    f"{_fmt_bytes(self.backward_bytes_avoided)} in backward"
                    if self.backward
                    else "no backward"
                )
            )
            + (
                ""
                if self.returned_logits == "not returned"
                else f"\n    logits output: {self.returned_logits} "
                f"({_fmt_bytes(self.returned_logits_bytes)} kept)"
            )
        )

    def _bytes_text(self) -> str:
        """``logits avoided``'s tensors, and what the peak should drop by."""
        sizes = self.logits_bytes
        if not sizes:
            return ""

        def items(keys):
            return ", ".join(f"{LOGITS_TENSORS[k]} {_fmt_bytes(sizes[k])}" for k in keys if sizes[k] != 0)

        kept = self.returned_logits_bytes
        returned = f", {_fmt_bytes(kept)} of them returned" if kept != 0 else ""
        peak = self.peak_bytes_avoided
        if not self.backward:
            made = (
                items(["logits"]) + returned,
                items(["float32_upcast"]),
                f"log-probabilities {_fmt_bytes(sizes['saved_log_probs'])}",
            )
            return (
                f"    logits avoided: {_fmt_bytes(self.forward_bytes_avoided)} in forward "
                f"({', '.join(part for part in made if part)}); no backward runs (no output needs a "
                "gradient)\n"
                f"    peak memory: about {_lower(peak['inductor'])} than plain Inductor's step (its "
                f"fused loss holds one [N, V] buffer), {_lower(peak['unfused'])} than an unfused "
                "step's (eager, aot_eager: the logits, or their float32 upcast, and their "
                "log-probabilities at once in forward), net of the tiles' "
                f"{_fmt_bytes(self.tile_buffer_bytes)}"
            )
        loss_grad = f"{self.loss_grad_ops}'s gradient {_fmt_bytes(sizes['loss_grad'])}"
        return (
            f"    logits avoided: {_fmt_bytes(self.forward_bytes_avoided)} in forward ({items(_FORWARD[:1])}"
            f"{returned}, {items(_FORWARD[1:])}), {_fmt_bytes(self.backward_bytes_avoided)} in backward "
            f"({items(_BACKWARD)})\n"
            f"    peak memory: about {_lower(peak['inductor'])} than plain Inductor's step (its "
            f"fused loss holds one [N, V] buffer), {_lower(peak['unfused'])} than an unfused "
            "step's (eager, aot_eager: saved log-probabilities, "
            f"{loss_grad} and logits gradient at once in backward), net of the tiles' "
            f"{_fmt_bytes(self.tile_buffer_bytes)}"
            + (
                f" and of the gradients they form meanwhile ({_fmt_bytes(self.grad_buffer_bytes)}, "
                "formed after an unfused step's peak)"
                if self.grad_buffer_bytes
                else ""
            )
        )


@dataclass
class Skip:
    """A candidate region left untouched, and why."""

    graph: int
    loss_source: str
    reason: str
    #: skipped because eager raises on this input (an int32 target): the region is left as Dynamo
    #: gave it, so the inner compiler decides; Inductor accepts some of these and returns a value
    eager_raises: bool = False

    def __str__(self) -> str:
        return f"[graph {self.graph}] SKIPPED {self.loss_source}\n    why: {self.reason}"


@dataclass
class GraphReport:
    """The pass's decisions on one graph that Dynamo produced."""

    index: int
    rewrites: list[Rewrite] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    #: with ``backend(validate=True)``: the ValidationResult of the first call (its ``oracle``
    #: says what the rewrite was compared with)
    validation: Any = None


@dataclass
class Report:
    """Every decision the pass made while a function was compiled."""

    graphs: list[GraphReport] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)  # Dynamo's reasons, while compiling
    #: what an integration (tile_pass.integrations) found in the stack around the model, e.g.
    #: TRL's own fused LM head; printed after the decisions
    hints: list[str] = field(default_factory=list)
    #: ``explain``'s call raised where a region was skipped because eager raises on its input:
    #: eager's error, reported instead of raised
    eager_error: str = ""

    @property
    def rewrites(self) -> list[Rewrite]:
        return [r for g in self.graphs for r in g.rewrites]

    @property
    def skipped(self) -> list[Skip]:
        return [s for g in self.graphs for s in g.skipped]

    def to_dict(self) -> dict[str, Any]:
        return {
            "graphs": len(self.graphs),
            "rewrites": [dataclasses.asdict(r) for r in self.rewrites],
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            "graph_breaks": list(self.graph_breaks),
            "hints": list(self.hints),
            "eager_error": self.eager_error,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [
            f"tile_pass: {len(self.graphs)} graph(s), {len(self.rewrites)} region(s) rewritten, "
            f"{len(self.skipped)} skipped"
        ]
        lines += [str(decision) for decision in (*self.rewrites, *self.skipped)]
        if not self.rewrites and not self.skipped:
            lines.append("no linear + cross_entropy candidate was found in the compiled graphs")
            if not self.hints and "trl" in sys.modules:
                lines.append(f"    hint: {_TRL_HINT}")
        for reason in self.graph_breaks:
            lines.append(f"graph break: {reason}")
            if hint := graph_break_hint(reason):
                lines.append(f"    fix: {hint}")
        lines += [f"hint: {hint}" for hint in self.hints]
        if self.eager_error:
            lines.append(f"eager raises on this input: {self.eager_error}")
        return "\n".join(lines)


# TRL is imported and nothing was found: the likeliest cause is TRL's own head
_TRL_HINT = (
    "TRL is imported: TRL's trainers (SFTTrainer, GRPOTrainer, DPOTrainer, KTOTrainer, RLOOTrainer) "
    "replace the model's forward with TRL's fused LM head (trl.trainer.utils.add_fused_lm_head), which "
    "computes per-token log-probs in its own chunks, so no projection of the model reaches tile_pass "
    "(TRL's selective_log_softmax on the model's logits, outside that head, is tiled as a row-wise region). "
    "tile_pass.integrations.trl.fused_lm_head_modules(trainer) tells whether the head was replaced, "
    "tile_pass.integrations.trl.hand_head_to_tile_pass(trainer) hands it to tile_pass (SFT: the "
    "model's own forward and loss; GRPO/RLOO/DPO/KTO: the same per-token outputs from the model's "
    "lm_head, tiled), and "
    "tile_pass.integrations.transformers.report(trainer) names what it found"
)


def graph_break_hint(reason: str) -> str:
    """The fix for a graph break Dynamo reported, where one is known."""
    if "Tensor.item()" in reason or "capture_scalar_outputs" in reason:
        return (
            "set torch._dynamo.config.capture_scalar_outputs = True (the scalar stays a tensor in the "
            "graph), or keep the count a tensor: divide by (labels != -100).sum() without .item()"
        )
    if "generic_jump" in reason or "Data-dependent branching" in reason:
        return (
            "a Python `if` on a tensor's value: compute both sides and choose with torch.where (or "
            "torch.cond), so the head and the loss stay in one graph"
        )
    if "Dynamic shape operator" in reason or "nonzero" in reason:
        return (
            "boolean-mask indexing (x[mask]) has a data-dependent shape: multiply by the mask (or use "
            "torch.where / ignore_index labels) instead, or set "
            "torch._dynamo.config.capture_dynamic_output_shape_ops = True"
        )
    if "Import failure" in reason or "Failure when attempting to import" in reason:
        return (
            "an import that fails inside the compiled code (an optional kernel tried in a try block, as "
            "OpenRLHF's log_probs_from_logits tries flash-attn's) ends the graph, and Dynamo runs the rest "
            "of that function eagerly: install the package, or import it once at module level, so the "
            "head and the loss stay in one graph (OpenRLHF: tile_pass.integrations.openrlhf."
            "hand_log_probs_to_tile_pass() swaps in its log-probs without the import)"
        )
    if "logging.Logger" in reason:
        from tile_pass._logging_calls import logging_break_hint

        return logging_break_hint(reason)
    return ""


def _lower(n: int | str) -> str:
    """``n`` bytes saved, said the right way round: a tiny batch's tiles can cost more than its logits."""
    if isinstance(n, int) and n < 0:
        return f"{_fmt_bytes(-n)} higher"
    return f"{_fmt_bytes(n)} lower"


def _fmt_bytes(n: int | str) -> str:
    if not isinstance(n, int):
        return f"{n} bytes"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
