"""The zoo: every causal-LM class of the installed transformers, built from a tiny config.

``run_family(model_type)`` builds the family's ``*ForCausalLM`` class (the one
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` names) from its config class's defaults shrunk to a
tiny model (0.1-4M parameters), with random weights from a fixed seed (nothing is
downloaded), runs one training step eagerly and one compiled with
``tile_pass.compile(model, "aot_eager", strict=True)`` from the same initial weights (the model as
transformers builds it: GPT-2-style classes keep their unset ``loss_type``, whose loss property
logs a once-only advisory that the entry point traces past), and classifies the family:

* ``rewritten``: the report has rewrites, and the loss, the returned logits and every
  parameter gradient match the eager step;
* ``not rewritten``: the report has none, with the reason it gives (or, where it found no
  candidate at all, the cause read from the graphs Dynamo produced: no projection to the
  vocabulary, no cross entropy, or a graph break between them);
* ``fails without tile_pass``: the step fails (or differs from eager) with plain
  ``torch.compile(backend="aot_eager")`` too;
* ``build fails``: the model cannot be built from a tiny config, or its eager step fails;
* ``FAILURE``: tile_pass's fault: a crash that plain ``aot_eager`` does not have, numbers
  that differ from eager where plain ``aot_eager``'s do not, or a graph that holds the LM
  head and its cross entropy left without a reason.

Used by ``tests/test_zoo.py`` and ``scripts/zoo.py``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TILE_PASS_STRICT", "1")  # internal errors of the pass raise

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import tile_pass  # noqa: E402

transformers.logging.set_verbosity_error()

REWRITTEN = "rewritten"
NOT_REWRITTEN = "not rewritten"
PLAIN_FAILS = "fails without tile_pass"
BUILD_FAILS = "build fails"
FAILURE = "FAILURE"
OUTCOMES = (REWRITTEN, NOT_REWRITTEN, PLAIN_FAILS, BUILD_FAILS, FAILURE)

VOCAB = 512
BATCH, SEQ = 2, 16
MAX_PARAMS = 20_000_000  # a tiny config that still holds more than this is not built
RTOL = 2e-4  # float32, compiled against eager: rtol and atol (relative to the tensor's max magnitude)

# ---------------------------------------------------------------------------------------------
# tiny configs
# ---------------------------------------------------------------------------------------------

_HIDDEN = 64
_HEADS = 4
_HEAD_DIM = _HIDDEN // _HEADS


def _names(value, names: str) -> dict[str, int]:
    return dict.fromkeys(names.split(), value)


# attribute name -> the largest value it keeps (a default that is already smaller stays)
SHRINK: dict[str, int] = {
    **_names(
        VOCAB,
        "vocab_size decoder_vocab_size vocab_size_per_layer_input audio_vocab_size "
        "pronunciation_vocab_size shape_vocab_size encoder_hash_byte_group_vocab unpadded_vocab_size "
        "codebook_size",
    ),
    **_names(
        _HIDDEN,
        "hidden_size d_model n_embd emb_dim embedding_dim dim hidden_size_global word_embed_proj_dim "
        "lru_width attention_hidden_size input_embedding_size output_embedding_size embedding_size "
        "backbone_hidden_size projector_input_dim projector_output_dim vision_output_dim ple_embed_dim "
        "out_hidden_size pronunciation_embed_dim shape_embed_dim mamba_d_ssm adapter_in_dim "
        "adapter_out_dim adapter_input_size router_hidden_size prompt_mid_dim downsample_hidden_size "
        "conv_output_size input_size vector_quantization_hidden_dimension dim_model_base "
        "hidden_size_per_layer_input text_hidden_size vision_hidden_size",
    ),
    **_names(
        2 * _HIDDEN,
        "intermediate_size ffn_dim d_ff d_inner dff dim_ff decoder_ffn_dim encoder_ffn_dim "
        "ffn_hidden_size feed_forward_size intermediate_size_mlp shared_expert_intermediate_size "
        "shared_experts_intermediate_size moe_shared_expert_intermediate_size expert_ffn_hidden_size "
        "dense_intermediate_size mlp_dim shared_intermediate_size n_inner",
    ),
    **_names(_HIDDEN, "moe_intermediate_size"),
    **_names(
        2,
        "num_hidden_layers n_layer num_layers n_layers decoder_layers encoder_layers num_decoder_layers "
        "num_encoder_layers conf_num_hidden_layers num_global_layers num_layers_per_stack "
        "n_recurrent_layers n_input_layers n_output_layers depth num_blocks num_lstm_layers "
        "n_layers_per_attn_res_block",
    ),
    **_names(
        _HEADS,
        "num_attention_heads n_head n_heads num_heads decoder_attention_heads encoder_attention_heads "
        "num_decoder_attention_heads num_encoder_attention_heads attention_heads conf_num_attention_heads "
        "index_n_heads swa_num_attention_heads linear_num_heads linear_num_value_heads mamba_n_heads "
        "mamba_num_heads num_attention_heads_per_layer heads_per_ngram",
    ),
    **_names(
        2,
        "num_key_value_heads num_kv_heads kv_n_heads swa_num_key_value_heads linear_num_key_heads "
        "num_query_groups",
    ),
    **_names(
        _HEAD_DIM,
        "head_dim d_head d_kv dim_head kv_channels attention_head_size attention_head_dim swa_head_dim "
        "linear_head_dim linear_key_head_dim linear_value_head_dim index_head_dim mamba_d_head "
        "mamba_head_dim mamba_headdim qk_head_dim v_head_dim kv_lora_rank q_lora_rank o_lora_rank d_rel "
        "attention_value_dim",
    ),
    **_names(_HEAD_DIM // 2, "qk_rope_head_dim qk_nope_head_dim rotary_dim"),
    **_names(
        4, "num_experts num_local_experts n_routed_experts moe_num_experts zero_expert_num num_centroids"
    ),
    **_names(
        2,
        "num_experts_per_tok num_experts_per_token moe_k moe_top_k moe_topk top_k index_topk "
        "centroid_intermediate_top_k index_topk_blocks",
    ),
    **_names(
        1,
        "n_shared_experts num_shared_experts moe_num_shared_experts n_group topk_group num_expert_group "
        "first_k_dense_replace num_dense_layers mamba_n_groups n_groups mamba_ngroups "
        "num_nextn_predict_layers num_kv_shared_layers",
    ),
    **_names(
        8,
        "sliding_window sliding_window_size attention_window_size local_attention "
        "local_attention_window_len attention_chunk_size keep_window_size window_size index_block_size "
        "block_size rel_extent",
    ),
    **_names(
        16,
        "state_size mamba_d_state ssm_state_size time_step_rank mamba_dt_rank laurel_rank gated_norm_rank "
        "adapter_rank loop_gate_rank hc_lowrank codebook_dim",
    ),
    **_names(32, "mamba_chunk_size chunk_size"),
}
# float attributes with these words in their names are set to 0.0 (eager and compiled draw differently)
_DROPOUT_WORDS = tuple("dropout pdrop layerdrop drop_path jitter mask_time_prob mask_feature_prob".split())
# token ids (ending so) beyond the shrunk vocabulary move to its top; the inputs avoid all of them
_SPECIAL_SUFFIXES = tuple(
    "token_id token_ids token_index padding_idx pad_index unk_index mask_index eos_index bos_index".split()
)
# nested dicts shrunk as sub-configs: these, *_config, and any that names its model_type
_SUB_CONFIGS = ("decoder", "encoder", "text_encoder", "audio_encoder")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _shrink_dict(d: dict, specials: list[int]) -> dict:
    """The shrunk copy of a config's ``to_dict()`` (sub-configs, as nested dicts, shrunk too)."""
    out = dict(d)
    old_layers = next((d[k] for k in _LAYER_COUNTS if _is_int(d.get(k))), None)
    for key, value in d.items():
        if isinstance(value, dict) and (
            "model_type" in value or key.endswith("_config") or key in _SUB_CONFIGS
        ):
            out[key] = _shrink_dict(value, specials)
        elif key in SHRINK and _is_int(value) and value > 0:
            out[key] = min(value, SHRINK[key])
        elif key in SHRINK and isinstance(value, list) and value and all(_is_int(v) for v in value):
            out[key] = [min(v, SHRINK[key]) for v in value]
        elif isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            out[key] = 0.0
    # per-layer lists are cut to the new layer count; lists of layer indices keep those below it
    new_layers = next((out[k] for k in _LAYER_COUNTS if _is_int(out.get(k))), None)
    if old_layers and new_layers and new_layers < old_layers:
        for key, value in d.items():
            if not isinstance(value, list) or key in SHRINK and len(value) != old_layers:
                continue
            if len(value) == old_layers:
                out[key] = list(out[key])[:new_layers]
            elif value and all(_is_int(v) and 0 <= v < old_layers for v in value) and "layer" in key:
                out[key] = [v for v in value if v < new_layers]
        if isinstance(d.get("per_layer_config"), dict):  # heterogeneous layers: {"05": {...}, ...}
            out["per_layer_config"] = {
                k: _shrink_dict(v, specials) if isinstance(v, dict) else v
                for k, v in d["per_layer_config"].items()
                if str(k).isdigit() and int(k) < new_layers
            }
    _consistent(d, out)
    if old_layers and new_layers and d.get("num_kv_shared_layers") == old_layers:
        out["num_kv_shared_layers"] = new_layers  # every layer reuses the caches: so it stays
    vocab = out.get("vocab_size")
    if _is_int(vocab):
        for key, value in out.items():
            if not key.endswith(_SPECIAL_SUFFIXES):
                continue
            if _is_int(value):
                if value >= vocab:
                    value = out[key] = vocab - 1 - len(specials)
                specials.append(value)
            elif isinstance(value, list) and all(_is_int(v) for v in value):
                fixed = []
                for v in value:
                    if v >= vocab:
                        v = vocab - 1 - len(specials)
                    specials.append(v)
                    fixed.append(v)
                out[key] = fixed
    if "use_cache" in out:
        out["use_cache"] = False
    if "is_decoder" in out:  # BERT-style encoders as *ForCausalLM / *LMHeadModel: causal, as meant
        out["is_decoder"] = True
    return out


def _consistent(d: dict, out: dict) -> None:
    """Sizes that other sizes determine, recomputed from the shrunk ones."""
    hidden = out.get("hidden_size")
    if (
        "head_dim" in out
        and out["head_dim"] is None
        and _is_int(hidden)
        and _is_int(out.get("num_attention_heads"))
    ):
        out["head_dim"] = _HEAD_DIM  # a default of None that the modeling code does not fill in
    if (
        "num_key_value_heads" in out
        and out["num_key_value_heads"] is None
        and _is_int(out.get("num_attention_heads"))
    ):
        out["num_key_value_heads"] = SHRINK["num_key_value_heads"]
    # as many key/value heads as query heads stays so (multi-head latent attention needs it)
    for kv in ("num_key_value_heads", "num_kv_heads"):
        if (
            _is_int(d.get(kv))
            and d.get(kv) == d.get("num_attention_heads")
            and _is_int(out.get("num_attention_heads"))
        ):
            out[kv] = out["num_attention_heads"]
    # multi-head latent attention (DeepSeek V2/V3): head_dim is the rotary part
    if _is_int(out.get("qk_rope_head_dim")):
        if _is_int(d.get("head_dim")) and d["head_dim"] == d["qk_rope_head_dim"]:
            out["head_dim"] = out["qk_rope_head_dim"]
        if _is_int(out.get("qk_head_dim")) and _is_int(out.get("qk_nope_head_dim")):
            out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    # Mamba 2 mixers: heads x head size is the inner size (d_ssm, else expand x hidden)
    for heads, size, expand, inner in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm"),
        ("num_heads", "head_dim", "expand", None),
        ("mamba_num_heads", "mamba_head_dim", "expand", None),
    ):
        if not (_is_int(out.get(heads)) and _is_int(out.get(size)) and _is_int(hidden)):
            continue
        total = out.get(inner) if inner else None
        if not _is_int(total):
            if not isinstance(out.get(expand), (int, float)):
                continue
            total = int(out[expand] * hidden)
        if total % out[size] == 0:
            out[heads] = total // out[size]


# Families whose default config does not build or run as it stands (each entry says why), or
# whose inputs must fit a shape the config fixes: these values are set after the shrink.
OVERRIDES: dict[str, dict] = {
    # the default config fails its own validation (its default text config is Gemma 4's, with
    # per-layer inputs, a MoE block and double-wide MLPs that the assistant does not allow)
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        }
    },
    # num_experts_per_tok defaults to None: torch.topk(k=None) fails
    "deepseek_v2": {"num_experts_per_tok": 2},
    # n_routed_experts / num_experts_per_tok default to None: torch.empty(None, ...) fails
    "dots1": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": _HIDDEN,
        "n_shared_experts": 1,
    },  # and moe_intermediate_size, n_shared_experts (None) multiply
    # layer_types defaults to None: the decoder layers index it
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # rope_parameters defaults to {}: the rotary embedding reads rope_parameters["full_attention"]
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # and clamps by clip_qkv (None)
    # training needs the sequence to be the axial position shape's product and a chunk multiple
    "reformer": {
        "axial_pos_shape": [4, 4],
        "axial_pos_embds_dim": [32, 32],
        "lsh_attn_chunk_length": 8,
        "local_attn_chunk_length": 8,
    },
}


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "rope_parameters":
            _merge(into[key], value)
        else:
            into[key] = value


def tiny_config(model_type: str):
    """The family's config: its class's defaults, shrunk. Returns ``(config, special token ids)``."""
    overrides = OVERRIDES.get(model_type, {})
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a default that fails validation, fixed by the overrides
        if not overrides:
            raise
        default = transformers.AutoConfig.for_model(model_type, **overrides)
    specials: list[int] = []
    shrunk = _shrink_dict(default.to_dict(), specials)
    _merge(shrunk, overrides)
    try:
        config = type(default).from_dict(shrunk)
    except Exception:  # some configs validate in ways a dict cannot satisfy: set the attributes
        config = copy.deepcopy(default)
        _set_attributes(config, shrunk)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config, sorted(set(specials))


def _set_attributes(config, values: dict):
    for key, value in values.items():
        current = getattr(config, key, None)
        if isinstance(current, transformers.PretrainedConfig) and isinstance(value, dict):
            _set_attributes(current, value)
        else:
            with contextlib.suppress(Exception):
                setattr(config, key, value)


def _model_class(class_name: str):
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise RuntimeError(f"transformers has no {class_name}")
    return cls


def _config_for(cls, config):
    """The config the class takes: the text sub-config where the class is a text model of a
    multimodal family (``MllamaForCausalLM`` takes ``MllamaTextConfig``)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    subs = [v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig)]
    with contextlib.suppress(ValueError):  # several text configs (MusicGen's text encoder and decoder)
        subs.insert(0, config.get_text_config())
    for sub in subs:
        if isinstance(sub, wanted):
            return sub
    return config


def build(model_type: str, class_name: str):
    """The model (random weights, seed 0, train mode) and the token ids the inputs avoid."""
    config, specials = tiny_config(model_type)
    cls = _model_class(class_name)
    config = _config_for(cls, config)
    with torch.device("meta"):
        meta = cls._from_config(config)
    params = sum(p.numel() for p in meta.parameters())
    if params > MAX_PARAMS:
        biggest = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
        raise _TooBig(
            f"the shrunk config still has {params / 1e6:.1f}M parameters (largest: {biggest[0]} "
            f"{list(biggest[1].shape)})"
        )
    del meta
    torch.manual_seed(0)
    model = cls._from_config(config)
    if model_type in POST_BUILD:
        POST_BUILD[model_type](model)
    model.train()
    return model, specials


# what a family needs set on the built model before its forward runs
POST_BUILD = {
    "xmod": lambda model: model.set_default_language(next(iter(model.config.languages))),
}


class _TooBig(Exception):
    pass


def inputs(vocab: int, specials: list[int], seed: int = 0):
    """input_ids ``[2, 16]`` drawn from the vocabulary less its special tokens; labels are the
    ids with a prompt and a tail ignored (-100)."""
    allowed = torch.tensor(sorted(set(range(vocab)) - set(specials)))
    g = torch.Generator().manual_seed(seed)
    ids = allowed[torch.randint(0, len(allowed), (BATCH, SEQ), generator=g)]
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, -2:] = -100
    return ids, labels


# ---------------------------------------------------------------------------------------------
# one step, and its comparison
# ---------------------------------------------------------------------------------------------


@dataclass
class Step:
    loss: torch.Tensor
    logits: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]


def step(model, fn, ids, labels) -> Step:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = fn(input_ids=ids, labels=labels)
    loss = out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)
    if loss is None:
        raise _NoLoss(f"{type(out).__name__} has no loss with labels given")
    loss.backward()
    logits = out.get("logits") if hasattr(out, "get") else None
    return Step(
        loss.detach().clone(),
        logits.detach().clone() if isinstance(logits, torch.Tensor) else None,
        {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()},
    )


class _NoLoss(Exception):
    pass


def _error(actual, expected, floor: float = 0.0) -> float:
    """The worst elementwise error in units of the allowed one (<= 1 passes): ``RTOL`` of the
    element plus ``RTOL`` of the tensor's largest magnitude (or of ``floor``, if larger)."""
    if actual is None and expected is None:
        return 0.0
    if actual is None or expected is None:
        present = actual if actual is not None else expected
        return 0.0 if not present.any() else float("inf")  # a missing gradient is a zero gradient
    if actual.shape != expected.shape:
        return float("inf")
    a, e = actual.double(), expected.double()
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return float("inf")
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    if not e.numel():
        return 0.0
    scale = max(e.abs().max().item(), floor)
    allowed = RTOL * e.abs() + RTOL * (scale if scale > 0 else 1.0)
    return ((a - e).abs() / allowed).max().item()


# A gradient that is zero in exact arithmetic (the key bias of softmax attention: the softmax
# does not change when every score of a row moves by the same amount) is rounding noise in
# float32, a different noise for every order of summation; its own largest magnitude is that
# noise. Gradients are therefore compared relative to the larger of their own largest magnitude
# and this fraction of the largest gradient of the model.
GRAD_FLOOR = 1e-3


def compare(actual: Step, expected: Step, floor: float = GRAD_FLOOR) -> tuple[float, str]:
    """The worst error in units of the tolerance and what it is in."""
    rows = [("loss", _error(actual.loss, expected.loss))]
    if expected.logits is not None:
        rows.append(("logits", _error(actual.logits, expected.logits)))
    largest = max(
        (g.abs().max().item() for g in expected.grads.values() if g is not None and g.numel()), default=0.0
    )
    for name, g in expected.grads.items():
        rows.append((f"grad {name}", _error(actual.grads.get(name), g, floor * largest)))
    what, worst = max(rows, key=lambda r: r[1])
    return worst, what


# ---------------------------------------------------------------------------------------------
# what the graphs hold
# ---------------------------------------------------------------------------------------------


@dataclass
class GraphInfo:
    heads: list[str] = field(default_factory=list)  # projections to the vocabulary
    losses: list[str] = field(default_factory=list)  # cross entropies / nll losses


def _summarise(gm: torch.fx.GraphModule, vocab: int) -> GraphInfo:
    info = GraphInfo()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        name = (
            node.target
            if isinstance(node.target, str)
            else getattr(node.target, "__name__", str(node.target))
        )
        value = node.meta.get("example_value")
        if "cross_entropy" in name or "nll_loss" in name:
            info.losses.append(name)
        elif (
            (
                name in ("linear", "matmul", "mm", "bmm", "einsum", "addmm")
                or "linear" in name
                or "matmul" in name
            )
            and isinstance(value, torch.Tensor)
            and value.ndim
            and value.shape[-1] == vocab
        ):
            info.heads.append(name)
    return info


class _Recorder:
    """A backend that notes what each graph holds, then hands it to ``inner``."""

    def __init__(self, inner, vocab):
        self.inner, self.vocab, self.graphs = inner, vocab, []

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs.append(_summarise(gm, self.vocab))
        return self.inner(gm, example_inputs, **kwargs)


def _no_candidate_cause(graphs: list[GraphInfo], breaks: list[str], vocab: int) -> tuple[str, bool]:
    """Why no candidate was found, read from the graphs; and whether that is tile_pass's fault
    (a graph holding the projection to the vocabulary and a cross entropy both)."""
    head = [i for i, g in enumerate(graphs) if g.heads]
    loss = [i for i, g in enumerate(graphs) if g.losses]
    where_breaks = f" (graph breaks: {'; '.join(breaks)})" if breaks else ""
    both = sorted(set(head) & set(loss))
    if both:
        return (
            f"no candidate reported, though graph {both[0]} holds a projection to the vocabulary and a "
            f"cross entropy ({graphs[both[0]].heads[0]}, {graphs[both[0]].losses[0]})",
            True,
        )
    if not graphs:
        return f"Dynamo produced no graph{where_breaks}", False
    if head and loss:
        return (
            f"a graph break separates the LM head (graph {head[0]}) from the cross entropy (graph "
            f"{loss[0]}){where_breaks}",
            False,
        )
    if not loss:
        return (
            f"no cross_entropy / nll_loss in the {len(graphs)} compiled graph(s): the loss is "
            f"computed otherwise{where_breaks}",
            False,
        )
    return (
        f"no projection to the vocabulary (V={vocab}) in the {len(graphs)} compiled graph(s){where_breaks}",
        False,
    )


# ---------------------------------------------------------------------------------------------
# the classification
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    model_type: str
    class_name: str
    outcome: str = ""
    reason: str = ""  # why not rewritten / what failed, in one line
    detail: str = ""  # the traceback summary, the errors, the report
    seconds: float = 0.0
    params: int = 0
    rewrites: int = 0
    max_error: float | None = None  # in units of the tolerance (<= 1 passes)
    #: the same relative to each gradient's own largest magnitude only (no GRAD_FLOOR), and where
    max_error_own_scale: float | None = None
    max_error_own_scale_in: str = ""
    #: where that error is above the tolerance: that gradient in a float64 eager step, and the
    #: float32 eager step's and tile_pass's errors against it
    float64_check: str = ""
    #: Dynamo's graph breaks in the step compiled with tile_pass (each reason's first line)
    graph_breaks: list[str] = field(default_factory=list)

    def to_dict(self):
        return asdict(self)


def families() -> list[tuple[str, str]]:
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    if (
        not seconds
        or not hasattr(signal, "SIGALRM")
        or signal.getsignal(signal.SIGALRM)
        not in (
            signal.SIG_DFL,
            signal.SIG_IGN,
            None,
        )
    ):
        yield
        return

    def _raise(signum, frame):
        raise _Timeout(f"took more than {seconds} s")

    signal.signal(signal.SIGALRM, _raise)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _frames(exc: BaseException) -> str:
    """The traceback's last frames, with tile_pass's own frames marked."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/tile_pass/" in f.filename]
    shown = [*ours[-4:], *frames[-3:]] if ours else frames[-5:]
    lines, seen = [], set()
    for f in shown:
        key = (f.filename, f.lineno)
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}: {f.line}")
    return "\n".join(lines)


def _backend(recorder: _Recorder):
    """``tile_pass.backend("aot_eager")`` with internal errors raised (``strict``, where it exists;
    ``TILE_PASS_STRICT=1`` is set above for versions that read only the variable), its graphs
    noted by ``recorder`` (which runs aot_eager: so the tiles stay uncompiled, as under aot_eager)."""
    if hasattr(tile_pass, "TileOptions") or "strict" in inspect.signature(tile_pass.backend).parameters:
        return tile_pass.backend(recorder, strict=True, compile_tiles=False)
    return tile_pass.backend(recorder, compile_tiles=False)


def run_family(model_type: str, class_name: str | None = None, time_limit: float | None = None) -> Result:
    class_name = class_name or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    result = Result(model_type, class_name)
    start = time.perf_counter()
    try:
        with _time_limit(time_limit):
            _classify(result)
    except _Timeout as exc:  # a stage already classified stands; else the time went on building
        if not result.outcome:
            result.outcome, result.reason = BUILD_FAILS, f"the build or the eager step {exc}"
    finally:
        torch._dynamo.reset()
        result.seconds = round(time.perf_counter() - start, 2)
    return result


def _classify(result: Result):
    # (d) build, eager step
    try:
        model, specials = build(result.model_type, result.class_name)
    except Exception as exc:  # noqa: BLE001 - every build failure is recorded with its text
        result.outcome, result.reason, result.detail = BUILD_FAILS, f"build: {_one_line(exc)}", _frames(exc)
        return
    result.params = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0] if _has_head(model) else model.config.vocab_size
    ids, labels = inputs(model.config.get_text_config().vocab_size, specials)
    pristine = copy.deepcopy(model)
    try:
        eager = step(model, model, ids, labels)
    except Exception as exc:  # noqa: BLE001
        result.outcome, result.reason, result.detail = (
            BUILD_FAILS,
            f"eager step: {_one_line(exc)}",
            _frames(exc),
        )
        return
    if not torch.isfinite(eager.loss):
        result.outcome, result.reason = BUILD_FAILS, f"eager step: the loss is {eager.loss.item()}"
        return

    # the step compiled with tile_pass
    torch._dynamo.reset()
    recorder = _Recorder(torch._dynamo.lookup_backend("aot_eager"), vocab)
    backend = _backend(recorder)
    compiled_model = copy.deepcopy(pristine)
    breaks_before = torch._dynamo.utils.counters["graph_break"].copy()
    try:
        with _time_limit_stage(result, "the step compiled with tile_pass"):
            ours = step(compiled_model, tile_pass.compile(compiled_model, backend), ids, labels)
    except Exception as exc:  # noqa: BLE001
        crash = exc
        ours = None
    else:
        crash = None
    breaks = [_summarise_break(r) for r in torch._dynamo.utils.counters["graph_break"] - breaks_before]
    result.graph_breaks = breaks
    report = backend.report()
    result.rewrites = len(report.rewrites)

    if crash is not None:
        plain = _plain(pristine, ids, labels, eager)
        if isinstance(plain, Exception):
            result.outcome = PLAIN_FAILS
            result.reason = f"plain aot_eager: {_one_line(plain)}"
            result.detail = _frames(plain)
        else:
            result.outcome = FAILURE
            result.reason = f"crash only with tile_pass: {_one_line(crash)}"
            result.detail = _frames(crash) + "\n" + str(report)
        return

    worst, what = compare(ours, eager)
    result.max_error = worst
    result.max_error_own_scale, result.max_error_own_scale_in = compare(ours, eager, floor=0.0)
    if worst > 1.0:
        plain = _plain(pristine, ids, labels, eager)
        if isinstance(plain, Exception):
            result.outcome, result.reason = PLAIN_FAILS, f"plain aot_eager: {_one_line(plain)}"
            return
        plain_worst, plain_what = plain
        if plain_worst > 1.0:
            result.outcome = PLAIN_FAILS
            result.reason = (
                f"plain aot_eager differs from eager too ({plain_what}: {plain_worst:.3g}x the tolerance; "
                f"with tile_pass {what}: {worst:.3g}x)"
            )
            return
        result.outcome = FAILURE
        result.reason = (
            f"wrong numbers {'with' if report.rewrites else 'without'} a rewrite: {what} is off by "
            f"{worst:.3g}x the tolerance (rtol={RTOL}, relative to its max magnitude); plain aot_eager "
            f"{plain_worst:.3g}x"
        )
        result.detail = str(report)
        return

    if report.rewrites:
        result.outcome = REWRITTEN
        result.reason = "; ".join(sorted({r.form for r in report.rewrites}))
        result.detail = str(report)
        if result.max_error_own_scale > 1.0 and result.max_error_own_scale_in.startswith("grad "):
            result.float64_check = _float64_check(
                pristine, ids, labels, result.max_error_own_scale_in[len("grad ") :], eager, ours
            )
        return
    result.outcome = NOT_REWRITTEN
    result.detail = str(report) + ("\n" + "\n".join(f"graph break: {b}" for b in breaks) if breaks else "")
    if report.skipped:
        result.reason = " | ".join(dict.fromkeys(s.reason for s in report.skipped))
        return
    cause, tile_pass_fault = _no_candidate_cause(recorder.graphs, breaks, vocab)
    result.reason = cause
    if tile_pass_fault:
        result.outcome = FAILURE


def _has_head(model) -> bool:
    with contextlib.suppress(Exception):
        head = model.get_output_embeddings()
        return head is not None and isinstance(getattr(head, "weight", None), torch.Tensor)
    return False


@contextlib.contextmanager
def _time_limit_stage(result: Result, stage: str):
    """A timeout while ``stage`` runs is recorded as that stage's (then re-raised)."""
    try:
        yield
    except _Timeout as exc:
        result.outcome, result.reason = FAILURE, f"{stage} {exc} (the eager step did not)"
        raise


def _plain(pristine, ids, labels, eager: Step):
    """The step compiled with plain aot_eager: its (worst error, where) against eager, or its exception."""
    torch._dynamo.reset()
    model = copy.deepcopy(pristine)
    try:
        plain = step(model, torch.compile(model, backend="aot_eager"), ids, labels)
    except Exception as exc:  # noqa: BLE001
        return exc
    finally:
        torch._dynamo.reset()
    return compare(plain, eager)


def _float64_check(pristine, ids, labels, name: str, eager: Step, ours: Step) -> str:
    """The gradient ``name`` in a float64 eager step, and both float32 steps' errors against it."""
    model = copy.deepcopy(pristine).double()
    try:
        exact = step(model, model, ids, labels)
    except Exception as exc:  # noqa: BLE001 - some kernels have no float64 (torch._grouped_mm)
        return f"no float64 step ({_one_line(exc, 120)})"
    ref, largest = (
        exact.grads.get(name),
        max((g.abs().max().item() for g in exact.grads.values() if g is not None and g.numel()), default=0.0),
    )
    if ref is None or eager.grads.get(name) is None or ours.grads.get(name) is None:
        return "no float64 gradient to compare with"
    size = ref.abs().max().item()
    err_eager = (eager.grads[name].double() - ref).abs().max().item()
    err_ours = (ours.grads[name].double() - ref).abs().max().item()
    return (
        f"float64: largest {size:.2g} ({size / largest:.2g} of the largest gradient); error of float32 "
        f"eager {err_eager:.2g}, of tile_pass {err_ours:.2g}"
    )


def _summarise_break(reason: str) -> str:
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    text = lines[0] if lines else str(reason)
    return text if len(text) <= 200 else text[:197] + "..."
