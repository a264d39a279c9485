"""A pipeline split written as Megatron-Core writes it: ``--partition "Et*4|(t*4|)*14tmL"``.

Megatron-Core's ``pipeline_model_parallel_layout`` (``megatron/core/transformer/pipeline_parallel_layer_layout.py``,
Megatron-LM d98e8a6, ``PipelineParallelLayerLayout.parse_str_to_list``) names every layer by a letter, ``E`` the
embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction layer, ``L`` the loss (the output layer
and its loss), and separates the virtual pipeline stages with ``|``, in the order of their first layer (virtual stage
k runs on pipeline rank k mod PP, as the interleaved placement here puts it). ``x*n`` repeats a letter and ``(...)*n``
a group; commas are cosmetic. Megatron-Bridge's DeepSeek-V3 recipes set such layouts (``"Et*4|(t*4|)*14tmL"`` on
GB300 at PP 2 × VP 8).

The model's layers here are the same kinds in the same order (``embed``, the decoder blocks, a DeepSeek model's
``mtp`` block, ``head``: the final norm, output layer and loss), so a layout is read as the layer counts of its
stages, and refused, with what is wrong, where its letters are not the model's layers in order: Megatron's own
checks (the embedding first and once, the loss last and once, as many decoders and MTP layers as the model has, the
decoders before the MTP layers), and one of the simulator's (every stage holds a layer).
"""

from __future__ import annotations

import re

from sim.core.errors import SpecError
from sim.models.graph import LayerGraph

__all__ = ["is_megatron_layout", "layout_stages", "layout_counts"]

#: Megatron-Core's layer letters (``parse_str_to_list``'s ``char2layer_type``), each with what it names.
LETTERS = {"E": "the embedding", "t": "a decoder layer", "m": "a multi-token-prediction layer", "L": "the loss"}
#: Most layers a layout may unroll to (a layout is checked against the model before anything is built from it; this
#: bounds the unrolling of a mistyped repetition such as ``t*99999999``).
MAX_LAYOUT_LAYERS = 1_000_000
_LAYOUT_TEXT = re.compile(r"[EtmL|()*,0-9]+")


def is_megatron_layout(text: str) -> bool:
    """Whether ``--partition``'s ``text`` is a Megatron layout (its letters and operators only, an ``E`` or a group
    first: every layout starts with the embedding) rather than a rule or layer counts."""
    return bool(_LAYOUT_TEXT.fullmatch(text)) and text[0] in "E("


def _unrolled(text: str) -> str:
    """``text`` with its repetitions written out, as ``parse_str_to_list`` unrolls them: groups ``(...)*n`` first,
    then single letters ``x*n``.

    Raises:
        SpecError: a repetition that would unroll past :data:`MAX_LAYOUT_LAYERS` letters.
    """
    flat = text.replace(",", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):
        for match in re.finditer(pattern, flat):
            if len(match.group(1)) * int(match.group(2)) > MAX_LAYOUT_LAYERS:
                raise SpecError(f"{{partition}} {text!r} repeats {match.group(0)!r} past {MAX_LAYOUT_LAYERS:,} layers",
                                "partition")
        flat = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), flat)
    return flat


def layout_stages(text: str) -> tuple[str, ...]:
    """The layer letters of each virtual stage of the layout ``text``, in order (``"Et|tL"`` → ``("Et", "tL")``).

    Raises:
        SpecError: a character that is not a layer letter once the repetitions are unrolled (an unmatched
            parenthesis, a ``*`` without a count), naming it and the letters there are.
    """
    stages = tuple(_unrolled(text).split("|"))
    for stage in stages:
        wrong = next((c for c in stage if c not in LETTERS), None)
        if wrong is not None:
            known = ", ".join(f"{letter} ({what})" for letter, what in LETTERS.items())
            raise SpecError(f"{{partition}} {text!r}: {wrong!r} is not a layer of a Megatron layout (layers: {known}; "
                            f"'|' between stages, x*n and (...)*n repeat)", "partition")
    return stages


def _letter(graph: LayerGraph, i: int) -> str | None:
    """The layout letter of the model's layer ``i``, or None for a layer no layout names."""
    layer = graph.layers[i]
    if layer.kind == "embedding":
        return "E"
    if layer.kind == "head":
        return "L"
    if layer.kind == "decoder":
        return "m" if layer.name.startswith("mtp") else "t"
    return None


def layout_counts(text: str, graph: LayerGraph, num_stages: int) -> tuple[int, ...]:
    """The layer counts of the stages of the Megatron layout ``text`` for ``graph`` (module docstring).

    Raises:
        SpecError: a layout that is not the model's layers in order, a stage without a layer, or a number of stages
            other than the plan's ``num_stages`` (PP × chunks), each saying what the layout and the model have.
    """
    stages = layout_stages(text)
    letters = [_letter(graph, i) for i in range(len(graph))]
    if None in letters:
        raise SpecError(f"{{partition}} {text!r} is a Megatron layout; {graph.spec.split(':')[0]} has layers a layout "
                        f"does not name (it names transformers: embedding, decoders, MTP, loss)", "partition")
    model = "".join(letters)  # type: ignore[arg-type]
    written = "".join(stages)
    if written != model:
        counts = {letter: (written.count(letter), model.count(letter)) for letter in LETTERS}
        wrong = [f"{LETTERS[letter]}: {have} written, {need} in the model" for letter, (have, need) in counts.items()
                 if have != need]
        why = "; ".join(wrong) if wrong else "the same layers in another order (E first, the decoders, m, L last)"
        raise SpecError(f"{{partition}} {text!r} does not lay out the model's layers ({why})", "partition")
    if len(stages) != num_stages:
        raise SpecError(f"{{partition}} {text!r} has {len(stages)} stages, the plan has {num_stages} (PP × chunks)",
                        "partition")
    empty = [k for k, stage in enumerate(stages) if not stage]
    if empty:
        raise SpecError(f"{{partition}} {text!r} leaves stage {empty[0]} without a layer; every stage needs one",
                        "partition")
    return tuple(len(stage) for stage in stages)
