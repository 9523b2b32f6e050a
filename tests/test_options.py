"""One options value at the front door: every entry point takes one ``tile_pass.TileOptions``
(``tiling=``) or builds it from its field names given as keywords, gets the same value either
way, and names the accepted keywords when it is given one it does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tile_pass
from tile_pass import TileOptions, _settings, _textbook

N, H, V = 12, 8, 13
OPTIONS = TileOptions(tile_tokens=4, tile_bytes=1 << 20, drop_logits=True)
FIELDS = dict(tile_tokens=4, tile_bytes=1 << 20, drop_logits=True)


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _head(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight), target)


def _configured(inner="aot_eager") -> TileOptions:
    """OPTIONS as an entry point configures it for ``inner``."""
    return OPTIONS.resolved(inner)


def test_resolution_decides_compiled_tiles_by_the_inner_compiler_and_strict_by_the_environment(monkeypatch):
    for inner, compiled in (("eager", False), ("aot_eager", False), ("inductor", True), (_head, True)):
        assert TileOptions().resolved(inner).compile_tiles is compiled
    assert TileOptions(compile_tiles=True).resolved("eager").compile_tiles is True
    for value, strict in (("1", True), ("0", False)):
        monkeypatch.setenv(_settings.STRICT_ENV, value)
        _settings.reload()
        assert TileOptions().resolved("eager").strict is strict
        assert tile_pass.backend("eager").strict is strict
        assert tile_pass.backend("eager", strict=not strict).strict is not strict
    monkeypatch.undo()
    _settings.reload()


@pytest.mark.parametrize("make", [tile_pass.backend, tile_pass.Backend], ids=["backend", "Backend"])
def test_backend_takes_the_value_or_its_fields(make):
    by_fields, by_value = make("aot_eager", **FIELDS), make("aot_eager", tiling=OPTIONS)
    assert by_fields.tiling == by_value.tiling == _configured()
    assert make("inductor", tiling=OPTIONS).tiling == _configured("inductor")
    # keywords replace the fields of a given value
    assert make("aot_eager", tiling=OPTIONS, tile_tokens=8).tiling.tile_tokens == 8
    # backend(options=...) stays Inductor's options, beside the tiling
    assert make("inductor", options={"max_autotune": True}, **FIELDS).options == {"max_autotune": True}


def test_tiled_loss_takes_the_value_or_its_fields():
    by_fields = tile_pass.tiled_loss(_head, inner="aot_eager", **FIELDS)
    by_value = tile_pass.tiled_loss(inner="aot_eager", tiling=OPTIONS)(_head)
    assert by_fields.tile_pass_backend.tiling == by_value.tile_pass_backend.tiling == _configured()


def test_explain_plans_with_the_value_given():
    torch._dynamo.reset()
    tiled = tile_pass.explain(_head, *_inputs(), tiling=TileOptions(tile_tokens=4))
    (rewrite,) = tiled.rewrites
    assert rewrite.tile_tokens == 4 and rewrite.compiled_tiles  # backend="tile_pass"'s inner: inductor
    torch._dynamo.reset()
    (same,) = tile_pass.backend(tile_tokens=4).explain(_head, *_inputs()).rewrites
    assert (same.tile_tokens, same.compiled_tiles) == (rewrite.tile_tokens, rewrite.compiled_tiles)


def test_linear_cross_entropy_takes_the_value_or_its_fields():
    hidden, weight, target = _inputs()
    keys = []
    for tiling in ({"tile_tokens": 4}, {"tiling": TileOptions(tile_tokens=4)}):
        _textbook._graphs.clear()
        loss = tile_pass.linear_cross_entropy(hidden, weight, target, **tiling)
        torch.testing.assert_close(loss, _head(hidden, weight, target))
        keys += list(_textbook._graphs)
    assert len(keys) == 2 and keys[0] == keys[1]
    expected = TileOptions(tile_tokens=4).resolved("eager")  # the functional API's tiles: uncompiled
    assert f"tiling={_textbook.constant_tiling(expected)}" in keys[0]


def test_linear_cross_entropy_takes_the_value_inside_torch_compile():
    hidden, weight, target = _inputs()
    tiling = TileOptions(tile_tokens=4)

    def loss(hidden, weight, target):
        return tile_pass.linear_cross_entropy(hidden, weight, target, tiling=tiling)

    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=True)(hidden, weight, target)
    torch.testing.assert_close(got, _head(hidden, weight, target))


def test_an_integration_forwards_the_value_or_its_fields():
    pytest.importorskip("transformers")
    from tile_pass.integrations.transformers import backend_of, compile_for_training

    by_fields = compile_for_training(torch.nn.Linear(H, V), "aot_eager", **FIELDS)
    by_value = compile_for_training(torch.nn.Linear(H, V), "aot_eager", tiling=OPTIONS)
    assert backend_of(by_fields).tiling == backend_of(by_value).tiling == _configured()


def test_torchtitan_override_builds_the_value_from_its_arguments():
    titan = pytest.importorskip("tile_pass.integrations.torchtitan")
    from torchtitan.components.loss import CrossEntropyLoss

    config = titan.tiled_loss(CrossEntropyLoss.Config(), inner="aot_eager", tile_tokens=4)
    assert config.tiling == TileOptions(tile_tokens=4)
    assert titan.tiled_loss(CrossEntropyLoss.Config(), tiling=OPTIONS).tiling == OPTIONS


def _call(entry):
    hidden, weight, target = _inputs()
    calls = {
        "backend": lambda **kw: tile_pass.backend("aot_eager", **kw),
        "Backend": lambda **kw: tile_pass.Backend("aot_eager", **kw),
        "tiled_loss": lambda **kw: tile_pass.tiled_loss(inner="aot_eager", **kw),
        "linear_cross_entropy": lambda **kw: tile_pass.linear_cross_entropy(hidden, weight, target, **kw),
    }
    return calls[entry]


@pytest.mark.parametrize("entry", ["backend", "Backend", "tiled_loss", "linear_cross_entropy"])
def test_an_unknown_keyword_names_the_accepted_ones_and_the_closest(entry):
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'tile_token' \(did you mean 'tile_tokens'"
    ) as info:
        _call(entry)(tile_token=4)
    assert "tile_tokens, tile_bytes, drop_logits, compile_tiles" in str(info.value)
    assert "tiling=" in str(info.value)
    with pytest.raises(TypeError, match="tiling= takes a tile_pass.TileOptions, got dict"):
        _call(entry)(tiling={"tile_tokens": 4})
    with pytest.raises(ValueError, match="tile_tokens must be a positive integer"):
        _call(entry)(tile_tokens=0)


def test_backend_settings_are_named_in_the_error():
    with pytest.raises(
        TypeError, match=r"'dumpdir' \(did you mean 'dump_dir'\?\).*own settings \(inner, dump_dir"
    ):
        tile_pass.backend("aot_eager", dumpdir="/tmp")
