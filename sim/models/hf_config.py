"""Models from HuggingFace ``config.json`` files: ``hf:PATH[,seq=S]`` and the shipped presets (``llama3.1-8b``).

A config is read as the JSON it is and turned into the keys of the ``llama`` family (:mod:`sim.models.llama`), so a
plan made from a config records an explicit ``llama:...`` spec that needs no file to be rebuilt (the executor, a
reader of ``plan.json``). The dense decoder families read:

* ``LlamaForCausalLM`` (Llama 2, 3, 3.1) and ``MistralForCausalLM``: no biases; Mistral's ``sliding_window`` where set;
* ``Qwen2ForCausalLM`` (Qwen 2, 2.5): biases on q, k and v (its attention's q, k, v projections have them, o none);
* ``Qwen3ForCausalLM``: an RMSNorm on each head's q and k (QK-norm), ``head_dim`` given by the config.

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

from sim.core.errors import SpecError
from sim.core.fileio import read_text
from sim.models import llama

__all__ = ["ARCHITECTURES", "PRESETS_DIR", "preset_names", "preset_config", "read_config", "llama_values",
           "resolve_config_spec"]

#: The architectures read, and what each family adds to the common decoder.
ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "Llama 2/3: no biases",
    "MistralForCausalLM": "Mistral: no biases, sliding window where configured",
    "Qwen2ForCausalLM": "Qwen 2/2.5: q, k, v biases",
    "Qwen3ForCausalLM": "Qwen 3: QK-norm, explicit head_dim",
}

#: Where the shipped configs live.
PRESETS_DIR = Path(__file__).with_name("configs")

#: What a config spec may set besides the config itself.
_OPTIONS = ("seq",)


def preset_names() -> tuple[str, ...]:
    """The shipped presets' names, sorted."""
    return tuple(sorted(path.stem for path in PRESETS_DIR.glob("*.json")))


def preset_config(name: str) -> dict[str, Any]:
    """The shipped config of preset ``name``.

    Raises:
        SpecError: no such preset (the message lists them).
    """
    if name not in preset_names():
        raise SpecError(f"unknown model preset {name!r} (presets: {', '.join(preset_names())})")
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
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise SpecError(f"model config {source}: architectures must list one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise SpecError(f"model config {source}: architecture {architecture} is not read (dense decoders read: "
                        f"{', '.join(ARCHITECTURES)})")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise SpecError(f"model config {source}: hidden_act {activation!r} is not read (the SwiGLU's silu only)")
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


def resolve_config_spec(spec: str) -> str | None:
    """The ``llama:`` spec of a config spec, or ``None`` when ``spec`` is not one.

    A config spec is ``hf:PATH`` or a preset name (``llama3.1-8b``), optionally followed by ``,seq=S`` (a preset also
    takes ``:seq=S``, the separator of every other model spec).

    Raises:
        SpecError: an option other than ``seq``, or what :func:`read_config` and :func:`llama_values` raise.
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
    values = llama_values(config, source)
    for pair in filter(None, (part.strip() for part in options.split(","))):
        key, eq, value = pair.partition("=")
        if not eq or key.strip() not in _OPTIONS:
            raise SpecError(f"a model config takes {', '.join(k + '=' for k in _OPTIONS)} only, got {pair!r} in "
                            f"{spec!r}")
        try:
            values[key.strip()] = int(value)
        except ValueError:
            raise SpecError(f"{key.strip()} must be an integer, got {value.strip()!r} in {spec!r}") from None
    return llama.NAME + ":" + ",".join(f"{key}={value}" for key, value in sorted(values.items()))
