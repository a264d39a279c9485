"""Every list of op kinds is the op table's (``sim.ir.ops.OP_SEMANTICS``): which compute op a collective or a message
follows, which ops make the input and weight gradients, zero bubble's I/W split. The table says it once; the
lowering, the cost view, the bound and the executor read it, and no module outside ``sim/ir`` spells a list of kinds
itself (a source scan, shown to catch a planted literal), except the two documented below."""

import ast
from pathlib import Path

import pytest

from executor import interpreter
from sim.ir.ops import (
    EP_KINDS,
    INPUT_GRADIENT_KINDS,
    OP_SEMANTICS,
    RECV_KINDS,
    SEND_KINDS,
    SPLIT_BACKWARD_KINDS,
    TP_KINDS,
    WEIGHT_GRADIENT_KINDS,
    Action,
    Op,
    OpKind,
    collective_after,
    message_kinds,
)
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.search.bound import stage_times

ROOT = Path(__file__).resolve().parents[3]
_SPELLINGS = frozenset(kind.value for kind in OpKind)

#: The literal lists of kinds allowed outside sim/ir, each with why the table cannot say it:
#: (path, the literal as ``ast.unparse`` writes it) -> reason.
ALLOWED = {
    ("sim/schedules/partime.py", "(OpKind.B, OpKind.R)"):
        "the ops of a PARTIME stream that work on the frame the stage's last forward left: its drain R is a "
        "forward of that frame, not a rebuild, so no kind property of the table picks them; the generator's own",
    ("executor/calibration.py", "(OpKind.F.value, OpKind.B.value)"):
        "the measured kinds a calibrated profile requires of every stage: its fields fwd and bwd, the profile's "
        "vocabulary rather than the table's",
}


def _is_kind(node: ast.expr) -> bool:
    """``OpKind.X``, ``OpKind.X.value`` or a kind's spelling (``"SEND_F"``)."""
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "OpKind":
        return True
    return isinstance(node, ast.Constant) and node.value in _SPELLINGS


def _names_each(node: ast.expr, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the literal gives each kind a name rather than listing them: ``F, B = (OpKind.F, OpKind.B)`` (local
    aliases), or ``f, b = (table[k] for k in (OpKind.F, OpKind.B))`` (one named value per kind)."""
    parent = parents.get(node)
    if isinstance(parent, ast.comprehension) and parent.iter is node:
        parent = parents.get(parents[parent])  # the generator's assignment
    return (isinstance(parent, ast.Assign) and len(parent.targets) == 1
            and isinstance(parent.targets[0], ast.Tuple) and len(parent.targets[0].elts) == len(node.elts))


def _maps_kinds(node: ast.Dict) -> bool:
    """Whether a dict literal maps kinds to kinds (``{OpKind.F: OpKind.TP_F, ...}``) in two entries or more: what one
    kind means for another is the table's ``follows``."""
    def kinds(value: ast.expr | None) -> bool:
        return value is not None and (_is_kind(value)
                                      or isinstance(value, ast.Tuple) and all(map(_is_kind, value.elts)))
    return sum(kinds(key) and kinds(value) for key, value in zip(node.keys, node.values)) >= 2


def kind_literals(source: str) -> list[str]:
    """Every tuple, list or set literal of ``source`` holding two kinds or more that does not name each one, and
    every dict literal mapping kinds to kinds."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(map(_is_kind, node.elts)) >= 2
            and not _names_each(node, parents) or isinstance(node, ast.Dict) and _maps_kinds(node)]


def _scanned() -> list[Path]:
    return [path for package in ("sim", "executor") for path in sorted((ROOT / package).rglob("*.py"))
            if path.parent != ROOT / "sim" / "ir"]


def test_no_module_outside_sim_ir_lists_kinds_itself():
    found = {(str(path.relative_to(ROOT)), literal) for path in _scanned()
             for literal in kind_literals(path.read_text())}
    assert found - set(ALLOWED) == set(), "derive these from sim.ir.ops (or document them in ALLOWED)"
    assert set(ALLOWED) - found == set(), "a documented exception is gone: drop it from ALLOWED"


def test_the_scan_catches_a_planted_list_and_lets_names_through():
    planted = ("x = kind in (OpKind.TP_F, OpKind.TP_B)\n"
               "y = span.kind in {'F', 'B'}\n"
               "z = [OpKind.SEND_F.value, OpKind.RECV_F.value]\n"
               "F, B = (OpKind.F, OpKind.B)\n"
               "f, b = (at[k] for k in (OpKind.F, OpKind.B))\n"
               "w = (OpKind.F,)\n"
               "after = {OpKind.F: OpKind.TP_F, OpKind.R: (OpKind.TP_R,)}\n"
               "handler = {OpKind.F: '_forward', OpKind.B: '_backward'}\n")
    assert sorted(kind_literals(planted)) == ["(OpKind.TP_F, OpKind.TP_B)",
                                              "[OpKind.SEND_F.value, OpKind.RECV_F.value]", "{'F', 'B'}",
                                              "{OpKind.F: OpKind.TP_F, OpKind.R: (OpKind.TP_R,)}"]


def test_what_each_kind_follows():
    """Megatron-LM §3: the f and g collectives of a layer run inside its forward, backward and recompute, so each TP
    (and EP) op follows one; B and I both make the input gradient that TP_B reduces and SEND_B sends."""
    assert collective_after(Action.TP_COLLECTIVE) == {OpKind.F: OpKind.TP_F, OpKind.B: OpKind.TP_B,
                                                      OpKind.I: OpKind.TP_B, OpKind.R: OpKind.TP_R}
    assert collective_after(Action.EP_COLLECTIVE) == {OpKind.F: OpKind.EP_F, OpKind.B: OpKind.EP_B,
                                                      OpKind.I: OpKind.EP_B, OpKind.R: OpKind.EP_R}
    assert message_kinds(OpKind.F) == (OpKind.SEND_F, OpKind.RECV_F)
    assert message_kinds(OpKind.B) == message_kinds(OpKind.I) == (OpKind.SEND_B, OpKind.RECV_B)
    with pytest.raises(KeyError):
        message_kinds(OpKind.W)  # the weight gradient stays on its stage
    assert INPUT_GRADIENT_KINDS == {OpKind.B, OpKind.I} == set(OP_SEMANTICS[OpKind.SEND_B].follows)
    assert WEIGHT_GRADIENT_KINDS == {OpKind.B, OpKind.W}
    followers = TP_KINDS | EP_KINDS | SEND_KINDS | RECV_KINDS
    assert {kind for kind, semantics in OP_SEMANTICS.items() if semantics.follows} == followers
    assert all(OP_SEMANTICS[source].compute for kind in followers for source in OP_SEMANTICS[kind].follows)


def test_the_split_backward_shares_a_backward_equally():
    """Zero bubble (Qi et al., ICLR 2024, §2): I and W each take one GEMM of the forward's size, half of B's two."""
    assert SPLIT_BACKWARD_KINDS == {OpKind.I: 0.5, OpKind.W: 0.5}
    assert sum(SPLIT_BACKWARD_KINDS.values()) == 1.0


def _zero_bubble_moe():
    """A lowered zb1p plan with TP 2 and EP 2: every F, I and their TP and EP ops."""
    return build_plan(PlanInputs("moe:layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,ffn=96,expert_ffn=32,"
                                 "experts=4,topk=2,vocab=100,seq=32", "8xA100", "zb1p", 4, tp=2, ep=2,
                                 sequence_parallel=True))


def test_the_lowering_puts_each_collective_after_a_kind_it_follows():
    plan = _zero_bubble_moe().plan
    seen = set()
    for program in plan.programs:
        for position, op in enumerate(program):
            if op.kind in TP_KINDS | EP_KINDS:
                # The EP op comes after the TP op after the compute op (Megatron-Core's dispatcher runs after the
                # layer's TP collectives): the compute op is the last non-collective before it.
                compute = next(o for o in reversed(program[:position]) if o.kind not in TP_KINDS | EP_KINDS)
                assert compute.kind in OP_SEMANTICS[op.kind].follows, (op.id, compute.id)
                assert (compute.vstage, compute.mb) == (op.vstage, op.mb)
                seen.add((compute.kind, op.kind))
            if op.kind in SEND_KINDS:
                # a SEND waits for the op that made what it sends, or for the last collective after that op
                (producer,) = (Op.parse(dep).kind for dep in op.deps)
                made_by = OP_SEMANTICS[producer].follows or (producer,)
                assert set(made_by) <= set(OP_SEMANTICS[op.kind].follows), (op.id, op.deps)
                seen.add((producer, op.kind))
    assert {(OpKind.F, OpKind.TP_F), (OpKind.I, OpKind.TP_B), (OpKind.F, OpKind.EP_F), (OpKind.I, OpKind.EP_B),
            (OpKind.EP_F, OpKind.SEND_F), (OpKind.EP_B, OpKind.SEND_B)} <= seen
    # the executor checks the same order against the same table
    assert interpreter._COLLECTIVE_SOURCE == {kind: OP_SEMANTICS[kind].follows for kind in TP_KINDS | EP_KINDS}


def test_the_cost_view_and_the_bound_charge_the_table_split_and_collectives():
    built = _zero_bubble_moe()
    view = built.costs
    times = stage_times(view, split_backward=True, recompute_full=False)
    for v in range(built.plan.num_vstages):
        b = view.compute_time(OpKind.B, v)
        assert b > 0
        for part, share in SPLIT_BACKWARD_KINDS.items():
            assert view.compute_time(part, v) == b * share
        assert view.compute_time(OpKind.I, v) + view.compute_time(OpKind.W, v) == pytest.approx(b, rel=1e-15)
        # the bound's drain-chain backward is the I and the collectives the table puts after an I
        after_i = [collective_after(action)[OpKind.I] for action in (Action.TP_COLLECTIVE, Action.EP_COLLECTIVE)]
        assert times.backward_s[v] == pytest.approx(
            view.compute_time(OpKind.I, v) + sum(view.collective_op(kind, v).seconds for kind in after_i), rel=1e-12)
        assert times.weight_backward_s[v] == view.compute_time(OpKind.W, v)
