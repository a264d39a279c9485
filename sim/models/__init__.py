"""The model zoo: compact specs such as ``gpt:layers=48,hidden=2048`` turned into a :class:`LayerGraph`.

Every model reads its keys with defaults and rejects unknown keys, so the graph's ``spec`` is canonical: all keys,
sorted, defaults filled in. ``build_model(graph.spec)`` rebuilds an equal graph, and the executor rebuilds the
torch modules from the same string.

``build_model(spec, sharding)`` builds instead the shard of the model one device holds under tensor, context and
expert parallelism (:mod:`sim.models.sharding`); ``gpt``, ``llama`` and ``moe`` are modelled sharded.

A HuggingFace config (``hf:PATH[,seq=S]``) or a shipped preset (``llama3.1-8b,seq=8192``, ``qwen3-30b-a3b``) is read
into the ``llama`` or ``moe`` family's keys first (:mod:`sim.models.hf_config`), so its graph's canonical spec is a
plain ``llama:...`` or ``moe:...`` spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sim.core.errors import SpecError, did_you_mean
from sim.core.spec import SpecParams, parse_spec
from sim.models import amoebanet, cnn, gpt, hf_config, llama, moe, supernet, uniform, vgg
from sim.models.blocks import BLOCKS
from sim.models.graph import LayerGraph, canonical_spec
from sim.models.loss import LOSSES
from sim.models.offload import offload_blocks
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES
from sim.models.sharding import NO_SHARDING, Sharding

__all__ = ["ModelEntry", "MODELS", "build_model", "format_model_list", "Sharding", "NO_SHARDING"]


@dataclass(frozen=True)
class ModelEntry:
    """One model of the zoo.

    Attributes:
        name: the spec name, e.g. ``"gpt"``.
        description: one line for ``--model list``.
        defaults: every key the model accepts, with its default value.
        build: reads the keys from a :class:`SpecParams` (rejecting unknown ones) and returns the graph.
        build_shard: the same for one device's tensor-parallel shard, or ``None`` for a model modelled whole only.
    """

    name: str
    description: str
    defaults: Mapping[str, int | float]
    build: Callable[[SpecParams], LayerGraph]
    build_shard: Callable[[SpecParams, Sharding], LayerGraph] | None = None


#: The models whose build takes a :class:`Sharding`.
_SHARDED = (gpt, llama, moe)

MODELS: Mapping[str, ModelEntry] = MappingProxyType(
    {
        module.NAME: ModelEntry(module.NAME, module.DESCRIPTION, MappingProxyType(dict(module.DEFAULTS)), module.build,
                                module.build if module in _SHARDED else None)
        for module in (uniform, gpt, llama, moe, cnn, supernet, vgg, amoebanet)
    }
)


def build_model(spec: str, sharding: Sharding = NO_SHARDING) -> LayerGraph:
    """Build the :class:`LayerGraph` for a model spec such as ``"gpt:layers=2,hidden=64"``.

    Args:
        spec: the model spec.
        sharding: the tensor-parallel shard one device holds (:mod:`sim.models.sharding`); the default, the whole
            model, gives the same graph as before sharding existed. The graph's ``spec`` is the model's canonical
            spec whatever the sharding.

    Raises:
        SpecError: an unknown model name (the message lists the known ones), an unknown key, a non-numeric,
            zero or negative size, or a model-specific constraint (``heads`` divides ``hidden``, odd ``kernel``);
            a sharding that changes the model (``tp > 1`` or selective recomputation) for a family other than gpt,
            llama and moe; ``tp`` not dividing gpt's ``heads``, or its ``seq`` under sequence parallelism.
    """
    spec = hf_config.resolve_config_spec(spec) or spec
    name, raw = parse_spec(spec)
    entry = MODELS.get(name)
    if entry is None:
        close = did_you_mean(name, [*MODELS, *hf_config.preset_names()])
        raise SpecError(f"unknown model {name!r} in spec {spec!r}{close} (known: {', '.join(sorted(MODELS))}; presets: "
                        f"{', '.join(hf_config.preset_names())}; hf:PATH for a HuggingFace config)")
    if sharding.cp > 1 and name not in (llama.NAME, moe.NAME):
        raise SpecError(f"context parallelism is modelled for the llama and moe families only, got {spec!r} with "
                        f"{sharding.describe()}")
    if sharding.blocks != BLOCKS[0] and name not in (llama.NAME, moe.NAME):
        raise SpecError(f"{sharding.blocks} blocks (--blocks) are modelled for the llama and moe families only, got "
                        f"{spec!r}")
    if sharding.offloaded_blocks and name not in (llama.NAME, moe.NAME):
        raise SpecError(f"activation offloading (--offload-activations) is modelled for the llama and moe families "
                        f"only, got {spec!r}")
    if sharding.recompute_modules != DEFAULT_RECOMPUTE_MODULES and name != moe.NAME:
        raise SpecError(f"--recompute-modules names Megatron-Core's modules of the moe family's blocks; {name}'s "
                        f"selective recomputation is its own (drop --recompute-modules)")
    if sharding.shapes_experts and name != moe.NAME:
        raise SpecError(f"expert parallelism, routing and capacity belong to the moe family, got {spec!r} with "
                        f"{sharding.describe()}")
    if sharding.changes_model and entry.build_shard is None:
        what = ("tensor parallelism" if sharding.tp > 1 else "selective recomputation" if sharding.selective_recompute
                else f"the {sharding.loss} loss (--loss)" if sharding.loss != LOSSES[0]
                else f"{sharding.blocks} blocks (--blocks)")
        names = [known for known, e in MODELS.items() if e.build_shard is not None]
        shardable = ", ".join(names[:-1]) + " and " + names[-1]
        raise SpecError(f"{what} is modelled for {shardable} only, got {spec!r} with {sharding.describe()}")
    _check_size(spec, raw)
    params = SpecParams(spec, raw)
    # A sharding that changes nothing (tp = 1, no selective recomputation) builds the whole model, as it always has.
    graph = entry.build_shard(params, sharding) if sharding.changes_model else entry.build(params)  # type: ignore[misc]
    params.finish()  # each build already does; this guards a model that forgets
    return offload_blocks(graph, sharding.offloaded_blocks) if sharding.offloaded_blocks else graph


#: Most layers (``layers``, supernet ``blocks``) one model may have. A graph of 100,000 layers builds and partitions
#: in seconds (``python -m sim.bench --partition`` times 10,000); far more would hang before any other check ran.
MAX_LAYERS = 100_000
#: Most candidates a supernet may hold (``blocks`` × ``choices``): its candidate table is built eagerly.
MAX_CANDIDATES = 1_000_000


def _check_size(spec: str, raw: Mapping[str, str]) -> None:
    """Refuse a model too large to build before anything is allocated (the values are checked again, fully, by
    the model's own build)."""
    def number(key: str) -> float:
        try:
            return float(raw.get(key, 0))
        except (TypeError, ValueError):
            return 0.0  # not a number: the model's own build names it
    for key in ("layers", "blocks"):
        if number(key) > MAX_LAYERS:
            raise SpecError(f"{key}={raw[key]} in {spec!r} is more than a model may have (at most {MAX_LAYERS:,})")
    if number("blocks") * max(number("choices"), 1) > MAX_CANDIDATES:
        raise SpecError(f"blocks × choices in {spec!r} is more than a supernet may hold (at most "
                        f"{MAX_CANDIDATES:,} candidates)")


def format_model_list() -> str:
    """Text for ``--model list``: each model's full default spec, then its description indented below; then the
    presets, each with its architecture, parameter count and the ``llama`` spec it stands for."""
    lines = []
    for name in sorted(MODELS):
        entry = MODELS[name]
        lines.append(canonical_spec(name, entry.defaults))
        lines.append(f"    {entry.description}")
    lines.append("")
    lines.append(f"presets (HuggingFace configs shipped in sim/models/configs; NAME[,seq=S], default seq "
                 f"{llama.DEFAULTS['seq']} for a dense decoder and {moe.DEFAULTS['seq']} for a mixture of experts; "
                 f"hf:PATH[,seq=S] reads your own):")
    for name in hf_config.preset_names():
        graph = build_model(name)
        architecture = hf_config.preset_config(name)["architectures"][0]
        lines.append(f"{name}  {architecture}, {graph.total_params:,} parameters")
        lines.append(f"    {graph.spec}")
    return "\n".join(lines)
