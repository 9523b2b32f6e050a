"""The zoo: every causal-LM class of the installed transformers, built from a tiny config (no
downloads), one training step compiled with tile_pass against the same step in eager.

Each family must end in an outcome that is not tile_pass's fault (``tests/zoo.py`` classifies):
rewritten with the loss and every gradient equal to eager's, not rewritten with a reason that
names a cause, failing with plain ``aot_eager`` too, or not buildable from a tiny config. A
crash only tile_pass has, or a number that differs, fails the test. A sample of families runs
by default; ``-m slow`` runs the rest (``python scripts/zoo.py`` runs them all and writes
``docs/models.md``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TILE_PASS_STRICT", "1")
pytest.importorskip("transformers")

import zoo  # noqa: E402

# run by default (about 30-40 s on 2 cores): dense (Llama, Qwen 2, Phi-3), tied embeddings
# (GPT-2, Gemma 2), a soft-capped head (Gemma 2), MoE routing (Mixtral; its router loss is off
# by default), biased projections and learned positions (OPT), multi-query parallel attention (Falcon)
SAMPLE = ("llama", "gpt2", "gemma2", "qwen2", "mixtral", "phi3", "opt", "falcon")
# built as transformers builds them, their loss_type is unset: the loss property's warning_once sits
# between the head and the loss, a graph break that tile_pass.compile traces past (run by default too)
LOGGING_FAMILIES = ("gpt2", "gpt-sw3", "openai-gpt", "ctrl", "bert", "bert-generation")
# ProphetNet's n-gram streams: the main stream's logits ``[:, 0]`` and the others' ``[:, 1:]``
# returned, the loss on the streams transposed to the front: selections of the tiles' rows
SELECTION_FAMILIES = ("prophetnet",)
FAMILIES = dict(zoo.families())
KNOWN = {*SAMPLE, *LOGGING_FAMILIES, *SELECTION_FAMILIES}
assert KNOWN <= set(FAMILIES), KNOWN - set(FAMILIES)

TIME_LIMIT = 300  # seconds per family


def _param(model_type):
    marks = () if model_type in KNOWN else (pytest.mark.slow,)
    return pytest.param(model_type, marks=marks, id=model_type)


@pytest.mark.parametrize("model_type", [_param(m) for m in FAMILIES])
def test_family(model_type):
    result = zoo.run_family(model_type, FAMILIES[model_type], time_limit=TIME_LIMIT)
    described = f"{result.class_name} ({model_type}): {result.outcome}: {result.reason}\n{result.detail}"
    assert result.outcome in zoo.OUTCOMES, described
    assert result.outcome != zoo.FAILURE, described
    assert result.reason.strip(), described  # every outcome says what happened
    if result.outcome == zoo.NOT_REWRITTEN:
        assert "no candidate region found" not in result.reason, described
        assert not result.reason.startswith("no candidate reported"), described
    if result.outcome == zoo.REWRITTEN:
        assert result.rewrites >= 1 and result.max_error is not None and result.max_error <= 1.0, described
    if model_type in SAMPLE + SELECTION_FAMILIES:  # the representative families are rewritten today
        assert result.outcome == zoo.REWRITTEN, described
    if model_type in LOGGING_FAMILIES:  # ... and these, with no graph break at a logging call
        assert result.outcome == zoo.REWRITTEN, described
        assert not [b for b in result.graph_breaks if "logging" in b], described


@pytest.mark.parametrize("model_type", LOGGING_FAMILIES)
def test_logging_families_are_built_with_the_logging_call_in_their_loss(model_type):
    """The zoo builds them as transformers does: their loss property still logs, so the test
    above covers the call between the head and the loss, not a model changed to avoid it."""
    model, _ = zoo.build(model_type, FAMILIES[model_type])
    assert getattr(model, "loss_type", None) is None
    assert model.get_output_embeddings() is not None


def test_tiny_config_shrinks_and_keeps_heads_consistent():
    config, specials = zoo.tiny_config("llama")
    assert config.vocab_size == zoo.VOCAB and config.hidden_size == 64 and config.num_hidden_layers == 2
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert all(0 <= t < zoo.VOCAB for t in specials)
    mla, _ = zoo.tiny_config("deepseek_v3")  # multi-head latent attention: head_dim is the rotary part
    assert mla.head_dim == mla.qk_rope_head_dim and mla.num_key_value_heads == mla.num_attention_heads
