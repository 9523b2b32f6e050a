"""Buffers a tile loop reuses from one tile to the next (tile_pass.tiles._tile_buffers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close_to_oracle, leaves, value_and_grads

import tile_pass
from tile_pass.tiles import _tile_loop

N, H, V, TILE = 48, 16, 96, 8


def teacher_kl(hidden, weight, labels, teacher_log_probs):
    """A distillation loss over the labelled tokens, the teacher's ``[N, V]`` log-probs an input."""
    student = F.log_softmax(F.linear(hidden, weight).float() / 2.0, dim=-1)
    kl = F.kl_div(student, teacher_log_probs, reduction="none", log_target=True).sum(-1)
    mask = (labels != -100).float()
    return (kl * mask).sum() / mask.sum()


@pytest.mark.parametrize("device", DEVICES)
def test_skipping_tiles_gather_a_teacher_into_one_buffer_and_stay_exact(device, monkeypatch):
    """Each tile that runs only its labelled tokens gathers its rows of the ``[N, V]`` teacher; on
    the CPU every tile's gather lands in one buffer (a fresh ``[tile, V]`` copy per tile is a fresh
    mapping under a small mmap threshold), and the loss and gradients are eager's."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::3] = -100  # skipped tokens in every tile: the loop gathers the others
    teacher = F.log_softmax(torch.randn(N, V, generator=gen), dim=-1)
    labels, teacher = labels.to(device), teacher.to(device)

    gathered = []
    tile_rows = _tile_loop._tile_rows

    def recording(*args):
        rows = tile_rows(*args)
        if rows[0] is not None:  # kept alive: a fresh copy per tile could not share an address
            gathered.extend(t for t in rows[1].tokens if t.dim() == 2 and t.shape[-1] == V)
        return rows

    monkeypatch.setattr(_tile_loop, "_tile_rows", recording)
    compiled = torch.compile(teacher_kl, backend=tile_pass.backend("aot_eager", tile_tokens=TILE))
    h, w = leaves(hidden.to(device), weight.to(device))
    loss, (grad_h, grad_w, _, _) = value_and_grads(compiled, [h, w, labels, teacher])
    h64, w64 = leaves(hidden.to(device), weight.to(device), dtype=torch.float64)
    ref, (ref_h, ref_w, _, _) = value_and_grads(teacher_kl, [h64, w64, labels, teacher.double()])

    assert_close_to_oracle(loss, ref, torch.float32, "loss")
    assert_close_to_oracle(grad_h, ref_h, torch.float32, "d hidden")
    assert_close_to_oracle(grad_w, ref_w, torch.float32, "d weight")
    assert len(gathered) >= 3, "the loop did not gather the teacher's rows tile by tile"
    if device == "cpu":
        assert len({t.data_ptr() for t in gathered}) == 1
