"""Models from HuggingFace ``config.json`` files: ``hf:PATH[,seq=S]`` and the shipped presets (``llama3.1-8b``).

A config is read as the JSON it is and turned into the keys of the ``llama`` family (:mod:`sim.models.llama`) or,
for a mixture of experts, of the ``moe`` family (:mod:`sim.models.moe`), so a plan made from a config records an
explicit ``llama:...`` or ``moe:...`` spec that needs no file to be rebuilt (the executor, a reader of
``plan.json``). The dense decoder families read:

* ``LlamaForCausalLM`` (Llama 2, 3, 3.1) and ``MistralForCausalLM``: no biases; Mistral's ``sliding_window`` where set;
* ``Qwen2ForCausalLM`` (Qwen 2, 2.5): biases on q, k and v (its attention's q, k, v projections have them, o none);
* ``Qwen3ForCausalLM``: an RMSNorm on each head's q and k (QK-norm), ``head_dim`` given by the config.

The mixture-of-experts families read (:func:`moe_values`):

* ``MixtralForCausalLM``: ``num_local_experts`` experts of width ``intermediate_size``, ``num_experts_per_tok``;
* ``Qwen3MoeForCausalLM``: ``num_experts`` of width ``moe_intermediate_size``, QK-norm; ``mlp_only_layers`` read
  where they are the first layers (dense of width ``intermediate_size``), ``decoder_sparse_step`` 1 only;
* ``GptOssForCausalLM``: biases on q, k, v and o, attention sinks, the router's and the experts' biases, the clamped
  SwiGLU (``swiglu_limit``), ``layer_types`` alternating ``sliding_attention`` (window ``sliding_window``) and
  ``full_attention`` from the first layer;
* ``DeepseekV3ForCausalLM``: latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``), ``n_routed_experts`` of width ``moe_intermediate_size`` and
  ``n_shared_experts``, the first ``first_k_dense_replace`` layers dense, sigmoid scores with the score-correction
  bias (``topk_method: noaux_tc``), and the multi-token-prediction modules ``num_nextn_predict_layers`` (the moe
  family's ``mtp``: DeepSeek-V3's config says 1, so its preset trains with the MTP module, as DeepSeek did (arXiv
  2412.19437 §2.2) and Megatron-Bridge's DeepSeek-V3 rows do unless marked "w/o MTP"; ``deepseek-v3,mtp=0`` is the
  main model alone, DeepSeek's 671 B), and the group-limited routing ``n_group``/``topk_group`` (the family's
  ``groups``/``group_topk``: a token's experts from 4 of 8 groups, arXiv 2412.19437 §2.1.2), which changes what a
  deduplicated dispatch sends (``--ep-dispatcher deduplicated``) and nothing else.

Fields read: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (absent: as
many as the query heads), ``head_dim`` (absent or null: hidden / heads), ``intermediate_size``, ``vocab_size``,
``tie_word_embeddings`` (absent: untied, the default of these families' config classes), ``hidden_act`` (SiLU only:
the SwiGLU), the sliding-window fields, and the biases. A setting the ``llama`` family cannot express (biases on the
o projection or the MLP, per-layer sliding windows, another activation) is refused by name rather than ignored.
Fields that change no cost (rotary scaling, token ids, norm epsilon, initialisation) are not read.

Presets are the configs in ``sim/models/configs/``, copied byte for byte from the models' published ``config.json``
(``../shared/data/hf-configs/README.md`` says where from); their name is the file's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sim.core.errors import SpecError, did_you_mean
from sim.core.fileio import read_text
from sim.models import llama, moe

__all__ = ["ARCHITECTURES", "MOE_ARCHITECTURES", "PRESETS_DIR", "preset_names", "preset_config", "read_config",
           "llama_values", "moe_values", "config_spec_values", "resolve_config_spec"]

#: The architectures read, and what each family adds to the common decoder.
ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "Llama 2/3: no biases",
    "MistralForCausalLM": "Mistral: no biases, sliding window where configured",
    "Qwen2ForCausalLM": "Qwen 2/2.5: q, k, v biases",
    "Qwen3ForCausalLM": "Qwen 3: QK-norm, explicit head_dim",
}

#: The mixture-of-experts architectures read (:func:`moe_values`), and what each adds.
MOE_ARCHITECTURES: Mapping[str, str] = {
    "MixtralForCausalLM": "Mixtral: softmax top-k over SwiGLU experts",
    "Qwen3MoeForCausalLM": "Qwen3-MoE: QK-norm, fine-grained experts",
    "GptOssForCausalLM": "GPT-OSS: biases, attention sinks, alternating sliding windows, clamped SwiGLU experts",
    "DeepseekV3ForCausalLM": "DeepSeek-V3: latent attention, a shared expert, first layers dense, sigmoid routing",
}

#: Where the shipped configs live.
PRESETS_DIR = Path(__file__).with_name("configs")

#: What a config spec may set besides the config itself.
_OPTIONS = ("seq",)
#: A mixture of experts' options besides: its multi-token-prediction modules, overriding the config's.
_MOE_OPTIONS = (*_OPTIONS, *moe.OPTIONAL)


def preset_names() -> tuple[str, ...]:
    """The shipped presets' names, sorted."""
    return tuple(sorted(path.stem for path in PRESETS_DIR.glob("*.json")))


def preset_config(name: str) -> dict[str, Any]:
    """The shipped config of preset ``name``.

    Raises:
        SpecError: no such preset (the message lists them).
    """
    if name not in preset_names():
        raise SpecError(f"unknown model preset {name!r}{did_you_mean(name, preset_names())} (presets: "
                        f"{', '.join(preset_names())})")
    return read_config(PRESETS_DIR / f"{name}.json")


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json``, given as the file or as a folder holding one.

    Raises:
        SpecError: the path does not exist, is a folder without ``config.json``, is too large, is not JSON, or holds
            something other than a JSON object; each message names the path.
    """
    target = Path(path)
    if target.is_dir():
        target = target / "config.json"
        if not target.is_file():
            raise SpecError(f"model config folder {path} holds no config.json")
    elif not target.is_file():
        raise SpecError(f"model config {path} does not exist (give a config.json or a folder holding one)")
    try:
        data = json.loads(read_text(target, "model config"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"model config {target} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise SpecError(f"cannot read model config {target}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"model config {target} holds a JSON {type(data).__name__}, not an object")
    return data


def _integer(config: Mapping[str, Any], key: str, source: str, *, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"model config {source}: {key} must be a positive integer, got {value!r}")
    return value


def _flag(config: Mapping[str, Any], key: str, source: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(f"model config {source}: {key} must be true or false, got {value!r}")
    return value


def llama_values(config: Mapping[str, Any], source: str) -> dict[str, int]:
    """The ``llama`` family's keys for a config of one of :data:`ARCHITECTURES` (``seq`` left at its default).

    Raises:
        SpecError: an architecture not in :data:`ARCHITECTURES` (the message says which are), a missing or malformed
            field, or a setting the family cannot express; each message names the config and the field.
    """
    architecture = _architecture(config, source)
    if architecture not in ARCHITECTURES:
        raise SpecError(f"model config {source}: architecture {architecture} is not a dense decoder (dense decoders "
                        f"read: {', '.join(ARCHITECTURES)})")
    for key in ("attention_bias", "mlp_bias"):
        if architecture != "Qwen2ForCausalLM" and _flag(config, key, source):
            raise SpecError(f"model config {source}: {key}: true is not read (the llama family has biases only on "
                            f"q, k and v, as Qwen 2 does)")
    heads = _integer(config, "num_attention_heads", source)
    hidden = _integer(config, "hidden_size", source)
    head_dim = config.get("head_dim")
    values = {
        "layers": _integer(config, "num_hidden_layers", source),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _integer(config, "num_key_value_heads", source, default=heads),
        "head_dim": 0 if head_dim is None else _integer(config, "head_dim", source),
        "ffn": _integer(config, "intermediate_size", source),
        "vocab": _integer(config, "vocab_size", source),
        "qkv_bias": int(architecture == "Qwen2ForCausalLM"),
        "qk_norm": int(architecture == "Qwen3ForCausalLM"),
        "tied": int(_flag(config, "tie_word_embeddings", source)),
        "window": 0,
    }
    if values["head_dim"] == hidden // heads and hidden % heads == 0:
        values["head_dim"] = 0  # the default: one canonical spec for the same model
    if architecture == "MistralForCausalLM" and config.get("sliding_window") is not None:
        values["window"] = _integer(config, "sliding_window", source)
    elif architecture.startswith("Qwen") and _flag(config, "use_sliding_window", source):
        # Qwen 2/3 apply the window from layer max_window_layers on: a per-layer window the family cannot express.
        raise SpecError(f"model config {source}: use_sliding_window: true is not read (Qwen's windows are per layer)")
    return values


def _architecture(config: Mapping[str, Any], source: str) -> str:
    """The config's one architecture, read by this module; its activation the SwiGLU's silu."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise SpecError(f"model config {source}: architectures must list one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES and architecture not in MOE_ARCHITECTURES:
        raise SpecError(f"model config {source}: architecture {architecture} is not read (read: "
                        f"{', '.join([*ARCHITECTURES, *MOE_ARCHITECTURES])})")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise SpecError(f"model config {source}: hidden_act {activation!r} is not read (the SwiGLU's silu only)")
    return architecture


def _zero_or_integer(config: Mapping[str, Any], key: str, source: str) -> int:
    """A field that may be absent or null (0) or a positive integer."""
    return 0 if config.get(key) is None else _integer(config, key, source)


def _windows(config: Mapping[str, Any], layers: int, source: str) -> tuple[int, int]:
    """``(window, window_period)`` of GPT-OSS's ``layer_types``: all full (no window), all sliding (period 1), or
    sliding and full alternating from the first layer (period 2); any other pattern is refused."""
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != layers:
        raise SpecError(f"model config {source}: layer_types must list the {layers} layers' attention, got {types!r}")
    sliding = [kind == "sliding_attention" for kind in types]
    if any(kind not in ("sliding_attention", "full_attention") for kind in types):
        raise SpecError(f"model config {source}: layer_types may hold sliding_attention and full_attention only")
    if not any(sliding):
        return 0, 1
    window = _integer(config, "sliding_window", source)
    for period in (1, 2):
        if sliding == [i % period == 0 for i in range(layers)]:
            return window, period
    raise SpecError(f"model config {source}: layer_types must be all sliding, all full, or alternate sliding and full "
                    f"from the first layer (the moe family's window_period 1 or 2)")


def moe_values(config: Mapping[str, Any], source: str) -> dict[str, int]:
    """The ``moe`` family's keys for a config of one of :data:`MOE_ARCHITECTURES` (``seq`` left at its default).

    Raises:
        SpecError: another architecture, a missing or malformed field, or a setting the family cannot express
            (per-layer sparsity other than the first layers dense, Qwen's per-layer sliding windows, a layer-type
            pattern other than alternation); each message names the config and the field.
    """
    architecture = _architecture(config, source)
    if architecture not in MOE_ARCHITECTURES:
        raise SpecError(f"model config {source}: architecture {architecture} is not a mixture of experts (read: "
                        f"{', '.join(MOE_ARCHITECTURES)})")
    heads, hidden = _integer(config, "num_attention_heads", source), _integer(config, "hidden_size", source)
    layers = _integer(config, "num_hidden_layers", source)
    values: dict[str, int] = {key: 0 for key in [*moe.DEFAULTS, *moe.OPTIONAL]}
    values.update(layers=layers, hidden=hidden, heads=heads, window_period=1,
                  kv_heads=_integer(config, "num_key_value_heads", source, default=heads),
                  vocab=_integer(config, "vocab_size", source), seq=int(moe.DEFAULTS["seq"]),
                  topk=_integer(config, "num_experts_per_tok", source),
                  tied=int(_flag(config, "tie_word_embeddings", source)))
    head_dim = config.get("head_dim")
    values["head_dim"] = 0 if head_dim is None or head_dim * heads == hidden else _integer(config, "head_dim", source)
    if architecture == "MixtralForCausalLM":
        values.update(experts=_integer(config, "num_local_experts", source),
                      expert_ffn=_integer(config, "intermediate_size", source))
        values["ffn"] = values["expert_ffn"]  # no dense layer: the key's value is never used
        if config.get("sliding_window") is not None:
            values["window"] = _integer(config, "sliding_window", source)
    elif architecture == "Qwen3MoeForCausalLM":
        if _flag(config, "use_sliding_window", source):
            raise SpecError(f"model config {source}: use_sliding_window: true is not read (Qwen's windows are per "
                            f"layer)")
        step = config.get("decoder_sparse_step", 1)
        if step != 1:
            raise SpecError(f"model config {source}: decoder_sparse_step must be 1 (every layer a mixture), got "
                            f"{step!r}")
        dense = config.get("mlp_only_layers", [])
        if not isinstance(dense, list) or dense != list(range(len(dense))):
            raise SpecError(f"model config {source}: mlp_only_layers must be the first layers (0, 1, ...), got "
                            f"{dense!r}")
        bias = int(_flag(config, "attention_bias", source))
        values.update(experts=_integer(config, "num_experts", source),
                      expert_ffn=_integer(config, "moe_intermediate_size", source),
                      ffn=_integer(config, "intermediate_size", source), dense_layers=len(dense), qk_norm=1,
                      qkv_bias=bias, o_bias=bias)
    elif architecture == "GptOssForCausalLM":
        bias = int(_flag(config, "attention_bias", source))
        clamp = config.get("swiglu_limit")
        if isinstance(clamp, bool) or not isinstance(clamp, int | float) or clamp <= 0 or clamp != int(clamp):
            raise SpecError(f"model config {source}: swiglu_limit must be a positive whole number, got {clamp!r}")
        window, period = _windows(config, layers, source)
        values.update(experts=_integer(config, "num_local_experts", source),
                      expert_ffn=_integer(config, "intermediate_size", source), qkv_bias=bias, o_bias=bias, sinks=1,
                      router_bias=1, expert_bias=1, swiglu_clamp=int(clamp), window=window, window_period=period)
        values["ffn"] = values["expert_ffn"]
    else:  # DeepseekV3ForCausalLM
        if config.get("moe_layer_freq", 1) != 1:
            raise SpecError(f"model config {source}: moe_layer_freq must be 1, got {config.get('moe_layer_freq')!r}")
        if _flag(config, "attention_bias", source):
            raise SpecError(f"model config {source}: attention_bias: true is not read for latent attention")
        method = config.get("topk_method", "noaux_tc")
        if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise SpecError(f"model config {source}: topk_method {method!r} is not read")
        values.update(experts=_integer(config, "n_routed_experts", source),
                      expert_ffn=_integer(config, "moe_intermediate_size", source),
                      shared_experts=_zero_or_integer(config, "n_shared_experts", source),
                      dense_layers=_zero_or_integer(config, "first_k_dense_replace", source),
                      ffn=_integer(config, "intermediate_size", source),
                      q_lora=_zero_or_integer(config, "q_lora_rank", source),
                      kv_lora=_integer(config, "kv_lora_rank", source),
                      head_dim=_integer(config, "qk_nope_head_dim", source),
                      rope_dim=_integer(config, "qk_rope_head_dim", source),
                      v_dim=_integer(config, "v_head_dim", source),
                      sigmoid=int(config.get("scoring_func", "softmax") == "sigmoid"),
                      router_bias=int(method == "noaux_tc"),
                      mtp=_zero_or_integer(config, "num_nextn_predict_layers", source))
        groups = _zero_or_integer(config, "n_group", source)
        if groups > 1:  # group-limited routing (a single group limits nothing)
            values.update(groups=groups, group_topk=_integer(config, "topk_group", source))
        values["kv_heads"] = heads  # every head has its own keys and values, up-projected from the latent
    return values


def config_spec_values(config: Mapping[str, Any], source: str) -> tuple[str, dict[str, int]]:
    """``(family, keys)`` of a config: the ``llama`` family's for a dense decoder, the ``moe`` family's for a mixture
    of experts (what :func:`llama_values` and :func:`moe_values` raise otherwise)."""
    if _architecture(config, source) in MOE_ARCHITECTURES:
        return moe.NAME, moe_values(config, source)
    return llama.NAME, llama_values(config, source)


def resolve_config_spec(spec: str) -> str | None:
    """The ``llama:`` or ``moe:`` spec of a config spec, or ``None`` when ``spec`` is not one.

    A config spec is ``hf:PATH`` or a preset name (``llama3.1-8b``), optionally followed by ``,seq=S`` and, for a
    mixture of experts, ``,mtp=M`` (a preset also takes ``:seq=S``, the separator of every other model spec).

    Raises:
        SpecError: an option other than ``seq`` (and a mixture's ``mtp``), or what :func:`read_config` and
            :func:`config_spec_values` raise.
    """
    text = spec.strip()
    if text.startswith("hf:"):
        path, _, options = text[3:].partition(",")
        if not path:
            raise SpecError(f"hf: needs a path to a config.json or a folder holding one, got {spec!r}")
        source, config = path, read_config(path)
    else:
        name, _, options = text.replace(":", ",", 1).partition(",")
        if name.strip() not in preset_names():
            return None
        source, config = f"{name.strip()} (preset)", preset_config(name.strip())
    family, values = config_spec_values(config, source)
    for pair in filter(None, (part.strip() for part in options.split(","))):
        key, eq, value = pair.partition("=")
        allowed = _MOE_OPTIONS if family == moe.NAME else _OPTIONS
        if not eq or key.strip() not in allowed:
            raise SpecError(f"a model config takes {', '.join(k + '=' for k in allowed)} only, got {pair!r} in "
                            f"{spec!r}")
        try:
            values[key.strip()] = int(value)
        except ValueError:
            raise SpecError(f"{key.strip()} must be an integer, got {value.strip()!r} in {spec!r}") from None
    return family + ":" + ",".join(f"{key}={value}" for key, value in sorted(values.items()))
