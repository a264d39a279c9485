"""Which parts of a mixture-of-experts block selective recomputation drops (``--recompute-modules``).

Megatron-Core's fine-grained recomputation names the submodules it re-runs (``recompute_modules`` in
``megatron/core/transformer/transformer_config.py``, Megatron-LM d98e8a6). Three of them are *output-discarding*
checkpoints (``CheckpointWithoutOutput``): the module's output is freed once the next op has consumed it and recomputed
at the start of the backward from inputs the block keeps anyway, so only that output's memory is saved and only that
module's forward is re-run. The moe family (:mod:`sim.models.moe`) models these three:

* ``layernorm``: the two block norms (``input_layernorm``, ``pre_mlp_layernorm``): their outputs and fp32 statistics;
* ``moe_act``: the routed experts' SwiGLU (its output, the down projection's input);
* ``mla_up_proj``: multi-latent attention's up-projections and rotary embedding (q, k, v, recomputed from the
  latents).

The default, :data:`DEFAULT_RECOMPUTE_MODULES`, is all three: the set Megatron-Core's MoE guide recommends for MoE
models (``megatron/core/transformer/moe/README.md``, "Fine-grained Recomputation"; ``mla_up_proj`` matters only under
latent attention). Recipes choose fewer: Megatron-Bridge's DeepSeek-V3 recipes on GB200 recompute ``mla_up_proj``
alone (``experiments/data/megatron-bridge/recipe_memory_settings.csv``). The other modules Megatron-Core takes are not
modelled: ``core_attn`` saves nothing under a fused attention (Megatron warns so), and ``mlp``, ``moe`` and
``shared_experts`` are whole-module checkpoints.
"""

from __future__ import annotations

__all__ = ["RECOMPUTE_MODULES", "DEFAULT_RECOMPUTE_MODULES", "check_recompute_modules", "parse_recompute_modules"]

#: The output-discarding modules modelled, in their canonical order (module docstring).
RECOMPUTE_MODULES = ("layernorm", "moe_act", "mla_up_proj")
#: What ``--recompute selective`` drops when ``--recompute-modules`` is not given: all of them.
DEFAULT_RECOMPUTE_MODULES = RECOMPUTE_MODULES


def check_recompute_modules(modules: tuple[str, ...]) -> None:
    """Raise ValueError unless ``modules`` is a non-empty tuple of distinct :data:`RECOMPUTE_MODULES` in their
    canonical order (what :func:`parse_recompute_modules` returns)."""
    if not isinstance(modules, tuple) or not modules:
        raise ValueError(f"recompute_modules must be a non-empty tuple of {', '.join(RECOMPUTE_MODULES)}, "
                         f"got {modules!r}")
    unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute module {unknown[0]!r} is not modelled; choose from {', '.join(RECOMPUTE_MODULES)}")
    if modules != tuple(name for name in RECOMPUTE_MODULES if name in modules):
        raise ValueError(f"recompute_modules must be distinct and in the order {', '.join(RECOMPUTE_MODULES)}, "
                         f"got {modules!r}")


def parse_recompute_modules(text: str) -> tuple[str, ...]:
    """The modules a comma-separated list names (``"mla_up_proj"``, ``"layernorm,moe_act"``), in canonical order.

    Raises:
        ValueError: an empty list, a name that is not one of :data:`RECOMPUTE_MODULES` or a repeated name, with the
            valid names.
    """
    names = [name.strip() for name in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise ValueError(f"recompute modules must be a comma-separated list of {', '.join(RECOMPUTE_MODULES)}, "
                         f"got {text!r}")
    unknown = [name for name in names if name not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute module {unknown[0]!r} is not modelled; choose from {', '.join(RECOMPUTE_MODULES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"recompute modules must be distinct, got {text!r}")
    return tuple(name for name in RECOMPUTE_MODULES if name in names)
