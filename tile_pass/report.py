"""What the pass did: one record per candidate region, readable as text or as a dict."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>.*)')


def source_line(node) -> str:
    """``file:line (function): code`` of the user frame that produced ``node``, or ``?``."""
    trace = node.meta.get("stack_trace") if node is not None else None
    frames = list(_FRAME.finditer(trace or ""))
    if not frames:
        return "?"
    last = frames[-1]
    path = last["file"].rsplit("/", 1)[-1]
    return f"{path}:{last['line']} ({last['func']}): {last['code'].strip()}"


@dataclass
class Rewrite:
    """A region replaced by the tiled loss."""

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
            + f"    logits avoided: {_fmt_bytes(self.forward_bytes_avoided)} in forward, "
            f"{_fmt_bytes(self.backward_bytes_avoided)} in backward"
            + (
                ""
                if self.returned_logits == "not returned"
                else f"\n    logits output: {self.returned_logits} "
                f"({_fmt_bytes(self.returned_logits_bytes)} kept)"
            )
        )


@dataclass
class Skip:
    """A candidate region left untouched, and why."""

    graph: int
    loss_source: str
    reason: str

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
    if "loss_type=" in reason:
        return (
            'transformers logs from its loss_function property; set model.loss_type = "ForCausalLM" '
            "before compiling so the head and the loss are traced in one graph"
        )
    if "logging.Logger" in reason:
        return "add that logging method to torch._dynamo.config.ignore_logging_functions"
    return ""


def _fmt_bytes(n: int | str) -> str:
    if not isinstance(n, int):
        return f"{n} bytes"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
