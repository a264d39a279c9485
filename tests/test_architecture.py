"""The import rules of docs/architecture.md, checked over the source with an AST walk.

Every ``import``/``from ... import`` of every module counts, including those inside functions (a lazy import
still ties two modules together). The checker is a function of the source tree, so the tests below also run it on a
copy with a planted violation of each rule and assert that it is caught: a rule test that cannot fail proves nothing.
"""

from __future__ import annotations

import ast
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "profiles", "experiments")

#: May a module of the first package import one of the second (DESIGN: profiles -> executor -> sim; experiments on
#: top; each package imports itself).
ALLOWED_PACKAGES = {
    "sim": {"sim"},
    "executor": {"executor", "sim"},
    "profiles": {"profiles", "executor", "sim"},
    "experiments": {"experiments", "profiles", "executor", "sim"},
}

#: The floors inside sim, lowest first: a module may import its own sub-package or a lower floor, never a higher one
#: or another sub-package on its own floor.
SIM_FLOORS = {
    "sim.core": 0,
    "sim.ir": 1,
    "sim.report": 2,  # reports read the IR and write files, nothing else
    "sim.hw": 2,
    "sim.models": 2,
    "sim.cost": 3,
    "sim.schedules": 4,
    "sim.faults": 4,  # a long run with failures: costs and models below it, sim.run above
    "sim.plan": 5,
    "sim.engine": 6,
    "sim.csp": 7,
    "sim.predict": 8,
    "sim.search": 9,
    "sim.run": 10,
    "sim.api": 10,  # the Python API: the same library calls as the commands, for notebooks
    "sim.bench": 10,
    "sim": 11,  # the public face, sim/__init__.py
}

#: What reports may import (DESIGN: "Reports import only the IR and file I/O").
REPORT_MAY_IMPORT = ("sim.core", "sim.ir", "sim.report")

#: Modules with a ``__main__`` block that are not user commands: the launcher re-enters itself in every worker
#: process (``python -m executor.launch MODULE ...``) to tie the worker's life to its launcher before anything else.
INTERNAL_ENTRY_POINTS = frozenset({"executor.launch"})

#: Simulator engines: the executor runs plans itself and asks sim.predict for the prediction, never an engine.
ENGINES = ("sim.engine", "sim.csp.simulate", "sim.csp.baselines")


#: Lines past which a module fails the suite. Modules are meant to hold one concept in 100-500 lines (the style
#: guide); a hard cap at that size made people squeeze docstrings and split by line count rather than by concept, so
#: the count is printed and watched (as tinygrad prints its line counts) and only a module far out fails.
MAX_MODULE_LINES = 800
#: How many of the longest modules the end-of-run summary lists.
SHOWN = 10
#: Where the length test leaves the longest modules for the summary (tests/conftest.py prints them).
LONGEST_MODULES = pytest.StashKey[list[tuple[str, int]]]()


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    return {module_name(root, path): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def module_lengths(root: Path) -> dict[str, int]:
    """Lines of every module of the tree at ``root``, by dotted name."""
    return {name: len(path.read_text().splitlines()) for name, path in collect_modules(root).items()}


def over_the_limit(lengths: dict[str, int]) -> dict[str, int]:
    """The modules of ``lengths`` over :data:`MAX_MODULE_LINES` lines."""
    return {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}


@functools.cache
def import_statements(source: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """Every import statement of a module's source, inside functions too, as ``(level, module, names)``: level -1
    for ``import a, b`` (module ``""``), else the ``from`` statement's level (0 absolute, 1 for ``from .``, ...).

    Cached by the source text: a tree scan is mostly this parse, and the planted-violation tests scan copies of the
    tree in which every module but the planted one has the text already parsed (the planted one is parsed anew).
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.append((-1, "", tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(found)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Absolute names this module imports: project modules where they resolve to one, else the top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    try:
        statements = import_statements(path.read_text())
    except SyntaxError as error:  # the cache is by text alone: name the file here
        error.filename = str(path)
        raise
    for level, base, names in statements:
        if level < 0:
            found.update(names)
            continue
        if level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in names:
            candidate = f"{base}.{alias}"
            found.add(candidate if candidate in modules else base)
    return found


def is_command(path: Path) -> bool:
    return '__name__ == "__main__"' in path.read_text()


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor_of(name: str) -> tuple[str, int]:
    """The sim sub-package (or top module) a module belongs to, and its floor."""
    best = max((key for key in SIM_FLOORS if within(name, key)), key=len)
    return best, SIM_FLOORS[best]


def violations(root: Path) -> list[str]:
    """Every broken import rule in the tree at ``root``, one line each (empty when the tree is clean)."""
    modules = collect_modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    problems: list[str] = []
    commands = {name for name, path in modules.items() if is_command(path)} - INTERNAL_ENTRY_POINTS
    for name, path in modules.items():
        top = name.split(".")[0]
        for target in sorted(imports_of(name, path, modules)):
            target_top = target.split(".")[0]
            if target in modules:
                graph.add_edge(name, target)
            if target_top in ("torch", "executor", "profiles", "experiments") and top == "sim":
                problems.append(f"{name} imports {target}: sim never imports torch or a package above it")
                continue
            if target_top in ALLOWED_PACKAGES and target_top not in ALLOWED_PACKAGES[top]:
                problems.append(f"{name} imports {target}: package {top} may not import {target_top}")
                continue
            if target in commands and target != name:
                problems.append(f"{name} imports the command module {target}")
            if top == "executor" and any(within(target, engine) for engine in ENGINES):
                problems.append(f"{name} imports the simulator engine {target}; ask sim.predict")
            if top == "sim" and target_top == "sim":
                problems.extend(_sim_floor_problems(name, target))
    for cycle in nx.simple_cycles(graph):
        problems.append("import cycle: " + " -> ".join([*cycle, cycle[0]]))
    packages = nx.DiGraph()
    for a, b in graph.edges:
        pa, pb = _package_of(a), _package_of(b)
        if pa != pb:
            packages.add_edge(pa, pb)
    for cycle in nx.simple_cycles(packages):
        problems.append("package cycle: " + " -> ".join([*cycle, cycle[0]]))
    return problems


def _package_of(name: str) -> str:
    top = name.split(".")[0]
    return floor_of(name)[0] if top == "sim" else top


def _sim_floor_problems(name: str, target: str) -> list[str]:
    home, floor = floor_of(name)
    there, target_floor = floor_of(target)
    if target == "sim":
        return [f"{name} imports the public face sim/__init__.py; import the module that defines the name"]
    if home == "sim.report" and not any(within(target, allowed) for allowed in REPORT_MAY_IMPORT):
        return [f"{name} imports {target}: reports import only the IR and file I/O"]
    if home == there:
        return []
    if target_floor >= floor:
        return [f"{name} (floor {floor}, {home}) imports {target} (floor {target_floor}, {there}): imports inside sim "
                f"go down the floors"]
    return []


# --- the rules hold on this repository ----------------------------------------------------------------------------


def test_the_repository_keeps_every_import_rule():
    assert violations(ROOT) == []


def test_every_module_is_seen_and_every_sim_package_has_a_floor():
    modules = collect_modules(ROOT)
    assert {"sim.engine.simpy_engine", "sim.ir.plan", "sim.run", "sim.report.gantt", "executor.run",
            "profiles.measure", "experiments.run"} <= set(modules)
    for name in modules:
        if name.startswith("sim."):
            floor_of(name)  # every sim module belongs to a known floor (raises on an unknown one)
            assert name.count(".") == 1 or floor_of(name)[0] != "sim", f"{name} is not in a floor of SIM_FLOORS"


def test_no_module_is_over_800_lines(request: pytest.FixtureRequest):
    """Module length is watched, not squeezed: the longest modules are printed at the end of the run (tests/conftest.py,
    section "longest modules"), and only a module far past the style guide's ~500 (MAX_MODULE_LINES) fails."""
    lengths = module_lengths(ROOT)
    request.config.stash[LONGEST_MODULES] = sorted(lengths.items(), key=lambda item: (-item[1], item[0]))[:SHOWN]
    assert over_the_limit(lengths) == {}


# --- and each rule catches a planted violation -------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path) == []
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


PLANTED = [
    ("sim.core.errors", "import torch", "sim never imports torch"),
    ("sim.ir.plan", "def late():\n    from executor import run", "sim never imports torch or a package above it"),
    ("executor.compare", "from profiles import measure", "package executor may not import profiles"),
    ("sim.ir.trace", "from experiments import run", "sim never imports"),
    ("profiles.measure", "import experiments.run", "package profiles may not import experiments"),
    ("executor.run_outputs", "from sim.engine.simpy_engine import simulate", "simulator engine"),
    ("executor.compare", "from sim import run", "command module sim.run"),
    ("sim.hw.topology", "from sim.cost.cost_view import CostView", "imports inside sim go down the floors"),
    ("sim.hw.topology", "from sim.models.graph import LayerGraph", "imports inside sim go down the floors"),
    ("sim.report.metrics", "from sim.hw.topology import Topology", "reports import only the IR"),
    ("sim.core.fileio", "import sim", "public face"),
    ("sim.engine.simpy_engine", "from sim.run import main", "command module sim.run"),
    ("sim.search.screen", "from sim.bench.fast import FastEvaluator", "imports inside sim go down the floors"),
    ("executor.nn.optim", "from executor.rank_process import worker_main", "import cycle"),
]


@pytest.mark.parametrize(("module", "line", "expected"), PLANTED, ids=[f"{m}:{e}" for m, _, e in PLANTED])
def test_a_planted_violation_is_caught(tree: Path, module: str, line: str, expected: str):
    _plant(tree, module, line)
    found = violations(tree)
    assert any(expected in problem for problem in found), found


def test_a_planted_module_over_800_lines_is_caught(tree: Path):
    path = tree / "sim" / "core" / "errors.py"
    path.write_text(path.read_text() + "\n" * MAX_MODULE_LINES)
    assert set(over_the_limit(module_lengths(tree))) == {"sim.core.errors"}


# --- at run time: sim loads neither torch nor matplotlib until a chart is drawn ------------------------------------


def test_sim_never_loads_torch_and_loads_matplotlib_lazily():
    sim_modules = sorted(name for name in collect_modules(ROOT) if within(name, "sim"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in sim_modules)
            + "print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.split())
    assert "torch" not in loaded
    assert "matplotlib" not in loaded


def test_importing_one_ir_module_does_not_load_an_engine():
    """The public face is lazy: ``import sim.ir.plan`` (what the executor does) must not pull in the SimPy engine."""
    code = "import sys, sim.ir.plan; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.split())
    assert not {name for name in loaded if within(name, "sim.engine") or name == "simpy"}
