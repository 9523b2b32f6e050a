"""Peak memory and time of one LM-head training step, measured in a fresh process.

The benchmark (:mod:`tile_pass.bench`) and the examples start a new interpreter per
measurement (:func:`run_fresh`) so that no allocator cache or compiled artefact of another
implementation skews the numbers.

CPU peak memory is ``VmHWM`` from ``/proc/self/status`` after resetting it (writing ``5``
to ``/proc/self/clear_refs``) once the step has been compiled and warmed up, minus the
resident size at that moment: the extra memory one step needs above its inputs and
parameters. ``MALLOC_MMAP_THRESHOLD_`` is pinned so freed tensors go back to the OS and
the resident size is a true baseline; the timed steps that follow run under glibc's own
steady-state thresholds (:func:`allocator_steady_state`). On CUDA it is
``torch.cuda.max_memory_allocated`` above the allocated bytes before the step.

The benchmark (:func:`measure_split`) separates the two: its child starts with the allocator a
user's process has, times the steps there with their minor page faults, and only then pins
glibc's thresholds (:func:`pin_allocator_for_peak`) for the peak step, so no timing pays for
the settings that make a peak readable.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

MiB = 1024 * 1024


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The pattern as user code writes it: linear, float32 upcast, cross entropy."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def lm_head_loss_no_upcast(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The pattern without the upcast: cross entropy on logits in the model dtype (eager
    computes it in float32 internally and returns the model dtype)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def z_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy plus the z-loss as OLMo-core writes it: the squared log-sum-exp of the
    labelled tokens (masked, averaged over every token), the logits read twice."""
    logits = F.linear(hidden, weight).float()
    ce = F.cross_entropy(logits, labels)
    return ce + 1e-4 * (logits.logsumexp(-1).pow(2) * (labels != -100)).mean()


#: tokens per sequence in the GRPO-style step
GRPO_SEQUENCE = 256


def grpo_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A GRPO-style policy step: per-token log-probs of the sampled ids, masked, averaged per
    sequence and weighted by each sequence's advantage (the labels stand in for the ids)."""
    logits = F.linear(hidden, weight).float()
    mask = (labels != -100).float()
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    counts = mask.view(-1, GRPO_SEQUENCE).sum(-1).clamp(min=1)
    per_sequence = (logp * mask).view(-1, GRPO_SEQUENCE).sum(-1) / counts
    advantages = torch.linspace(-1.0, 1.0, per_sequence.shape[0], device=hidden.device)
    return -(advantages * per_sequence).mean()


def entropy_bonus(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy minus an entropy bonus over the labelled tokens (softmax and log-softmax)."""
    logits = F.linear(hidden, weight).float()
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    mask = (labels != -100).float()
    return F.cross_entropy(logits, labels) - 0.01 * (entropy * mask).sum() / mask.sum()


#: TRL's sampling temperature in the ``grpo_trl`` form
GRPO_TEMPERATURE = 0.7


def grpo_trl(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRL's GRPO loss as TRL writes it, on sequences of :data:`GRPO_SEQUENCE` tokens: the logits
    sliced to the predictions of the next token (``logits[:, :-1, :]``), divided by the sampling
    temperature, ``log_softmax`` + ``gather`` of the completion ids (the labels shifted by one),
    the policy-gradient term ``-exp(logp - logp.detach()) * advantage`` masked by the completion
    mask (labelled tokens) and averaged per sequence, then over the sequences."""
    logits = F.linear(hidden.view(-1, GRPO_SEQUENCE, hidden.shape[-1]), weight).float()
    logits = logits[:, :-1, :]
    logits = logits / GRPO_TEMPERATURE
    ids = labels.view(-1, GRPO_SEQUENCE)[:, 1:]
    mask = (ids != -100).float()
    logp = logits.log_softmax(-1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, ids.shape[0], device=hidden.device)
    per_token = -torch.exp(logp - logp.detach()) * advantages.unsqueeze(1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


#: the distillation temperature of the ``kl_teacher`` form
KL_TEMPERATURE = 2.0


def kl_teacher(hidden, weight, labels, teacher_log_probs) -> torch.Tensor:
    """Distillation: ``KL(teacher || student)`` at temperature :data:`KL_TEMPERATURE` over the
    labelled tokens, the teacher's log-probabilities given (``[N, V]``, an input of the step, as
    stored teacher outputs are), scaled by ``T^2``."""
    student = F.log_softmax(F.linear(hidden, weight).float() / KL_TEMPERATURE, dim=-1)
    kl = F.kl_div(student, teacher_log_probs, reduction="none", log_target=True).sum(-1)
    mask = (labels != -100).float()
    return (kl * mask).sum() / mask.sum() * KL_TEMPERATURE**2


def _teacher_log_probs(hidden, weight, labels) -> tuple[torch.Tensor]:
    g = torch.Generator(device=hidden.device).manual_seed(1)
    logits = torch.randn(labels.shape[0], weight.shape[0], generator=g, device=hidden.device) * 2.0
    return (F.log_softmax(logits / KL_TEMPERATURE, dim=-1),)


#: the loss forms the step and the benchmark measure, by name
LOSS_FORMS = {
    "ce": lm_head_loss,
    "ce_nocast": lm_head_loss_no_upcast,
    "ce_zloss": z_loss,
    "grpo": grpo_log_probs,
    "grpo_trl": grpo_trl,
    "entropy": entropy_bonus,
    "kl_teacher": kl_teacher,
}
#: forms that take inputs beyond (hidden, weight, labels): how to make them, deterministically
_FORM_INPUTS = {"kl_teacher": _teacher_log_probs}


def form_inputs(form: str, hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    """The inputs ``form`` takes after ``(hidden, weight, labels)`` (inputs of the step, as a
    batch is: not counted in its peak memory)."""
    make = _FORM_INPUTS.get(form)
    return make(hidden, weight, labels) if make is not None else ()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_memory(device: torch.device) -> int:
    """Reset the peak counter; return the bytes in use now (the baseline)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _rss_kib("VmRSS") * 1024


def peak_memory(device: torch.device) -> int:
    """Peak bytes since :func:`reset_peak_memory`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _rss_kib("VmHWM") * 1024


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def allocator_steady_state() -> None:
    """Give glibc back the thresholds it settles on by itself once large blocks have been
    freed (blocks above 32 MiB mapped fresh, the heap trimmed above 64 MiB).

    The fresh process starts with small ones (:data:`FRESH_PROCESS_ENV`) so that the peak
    memory step sees every freed byte leave; timing under them would instead charge each
    allocation above 64 KiB with page faults that a normal process does not pay, which
    penalises code that allocates per tile (measured: tile_pass bf16 0.74 s vs 0.62 s).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * MiB)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * MiB)
    except (OSError, AttributeError):  # not glibc: nothing was pinned
        pass


class StepMeasurement(NamedTuple):
    times: list[float]  # sorted seconds of the timed steps (allocator steady state)
    peak_above: int  # peak bytes of the memory step above what was in use before it
    loss: torch.Tensor  # of the last step
    memory_step_s: float  # the memory step's own time, under the same allocator as a first call
    #: peak bytes of one more step under glibc's own (steady-state) thresholds, above the
    #: resident size before it: what a process that never pinned its allocator sees, which
    #: depends on what the allocator kept from earlier steps (CPU only; CUDA: ``peak_above``)
    peak_above_steady: int = 0


def timed(fn, device: torch.device) -> tuple:
    """``(fn(), seconds it took)``, the device's queued work included."""
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


def measure_steps(step, device: torch.device, repeats: int) -> StepMeasurement:
    """Run ``step`` (it clears the grads itself) once for peak memory, then ``repeats`` times
    for time under the allocator's steady state."""
    base = reset_peak_memory(device)
    loss, memory_step_s = timed(step, device)
    peak_above = peak_memory(device) - base
    allocator_steady_state()
    times = []
    for _ in range(max(1, repeats)):
        loss, seconds = timed(step, device)
        times.append(seconds)
    base = reset_peak_memory(device)
    step()
    peak_above_steady = peak_memory(device) - base
    return StepMeasurement(sorted(times), peak_above, loss, memory_step_s, peak_above_steady)


def training_step(fn, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, extra=()):
    """One forward+backward of ``fn`` that clears the gradients first; returns the loss."""

    def step():
        hidden.grad = None
        weight.grad = None
        loss = fn(hidden, weight, labels, *extra)
        loss.backward()
        return loss

    return step


FRESH_PROCESS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
#: the glibc settings under which a peak is readable (every freed block leaves the resident set),
#: set at run time by :func:`pin_allocator_for_peak` with the same values as :data:`FRESH_PROCESS_ENV`
PEAK_ALLOCATOR = {"M_MMAP_THRESHOLD": 64 * 1024, "M_TRIM_THRESHOLD": 0}


def allocator_env() -> dict[str, str]:
    """The glibc allocator variables this process was started with (``{}``: glibc's defaults,
    a dynamic mmap threshold from 128 KiB up to 32 MiB), as the rows record them."""
    return {
        name: value for name, value in os.environ.items() if name.startswith(("MALLOC_", "GLIBC_TUNABLES"))
    }


def pin_allocator_for_peak() -> bool:
    """Switch glibc to :data:`PEAK_ALLOCATOR` and return its free memory to the OS, so that the
    next step's ``VmHWM`` above the resident size is what that step needs.

    Run after the timed steps: the switch fixes glibc's thresholds for the rest of the process
    (it no longer adapts them), which is what a timing must not see. ``False`` where glibc is not
    the allocator (the peak then includes whatever the allocator keeps).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, PEAK_ALLOCATOR["M_MMAP_THRESHOLD"])
        libc.mallopt(_M_TRIM_THRESHOLD, PEAK_ALLOCATOR["M_TRIM_THRESHOLD"])
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def minor_faults() -> int:
    """Minor page faults of this process so far (pages first touched: a fresh mapping's cost)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_faults(fn, device: torch.device) -> tuple:
    """``(fn(), seconds, minor page faults)`` of one call."""
    before = minor_faults()
    result, seconds = timed(fn, device)
    return result, seconds, minor_faults() - before


class SplitMeasurement(NamedTuple):
    times: list[float]  # seconds of the timed steps, in order, under the process's own allocator
    faults: list[int]  # minor page faults of each timed step
    peak_above: int  # peak bytes of the peak step (PEAK_ALLOCATOR) above the resident size before it
    peak_faults: int  # that step's minor page faults: every block above 64 KiB freshly mapped
    peak_step_s: float  # that step's time
    peak_above_steady: int  # the peak of one more step under the process's own allocator
    loss: torch.Tensor  # of the last timed step
    peak_pinned: bool  # whether PEAK_ALLOCATOR could be set (glibc)


def measure_split(step, device: torch.device, repeats: int, clear=None) -> SplitMeasurement:
    """Time ``repeats`` steps under the allocator this process was started with (a user's
    process: glibc's defaults unless its environment says otherwise), counting each step's
    minor page faults; then one step's peak under those settings; then switch glibc to
    :data:`PEAK_ALLOCATOR` (:func:`pin_allocator_for_peak`) and measure the readable peak.

    Timing first, peak last: a peak setting maps and unmaps every block above 64 KiB, so a step
    timed under it pays page faults per allocation that a training process does not. ``clear``
    drops what the previous step left (its gradients) before each peak's baseline is read: the
    gradients a step returns belong to its peak, as in a process's first step.
    """
    times, faults = [], []
    loss = None
    for _ in range(max(1, repeats)):
        loss, seconds, count = timed_faults(step, device)
        times.append(seconds)
        faults.append(count)
    if clear is not None:
        clear()
    base = reset_peak_memory(device)
    step()
    peak_above_steady = peak_memory(device) - base
    if clear is not None:
        clear()
    pinned = device.type == "cpu" and pin_allocator_for_peak()
    base = reset_peak_memory(device)
    _, peak_step_s, peak_faults = timed_faults(step, device)
    peak_above = peak_memory(device) - base
    return SplitMeasurement(
        times, faults, peak_above, peak_faults, peak_step_s, peak_above_steady, loss, pinned
    )


def run_fresh(
    argv: list[str],
    timeout: float = 1800,
    env: dict[str, str] | None = None,
    allocator: dict[str, str] | None = None,
) -> dict:
    """Run ``python *argv`` in a fresh interpreter; parse the JSON of its last output line.

    ``env`` adds variables on top of ``allocator`` (default :data:`FRESH_PROCESS_ENV`; ``{}``
    leaves the parent's allocator settings, glibc's defaults unless set), e.g. an Inductor switch
    that must be set before torch is imported.
    """
    allocator = FRESH_PROCESS_ENV if allocator is None else allocator
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=dict(os.environ, **allocator, **(env or {})),
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {argv} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
