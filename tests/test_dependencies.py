"""Every third-party module the product imports is a declared dependency (pyproject.toml), so a fresh install runs it.

A terminal run of ``sim.search`` once died with ``No module named 'tqdm'``: the progress bar imported a package the
project never declared, and no test saw it because the bar only draws on a terminal. The check walks every module's
AST (imports inside functions count: a lazy import fails as late as it is reached) and compares each top-level name
with the distributions ``pyproject.toml`` declares, in the base set or an extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "profiles", "experiments")

#: Import names whose distribution is spelt otherwise.
DISTRIBUTION_OF = {"yaml": "pyyaml"}

def declared_distributions(pyproject: Path) -> set[str]:
    """The distribution names ``pyproject`` declares: its dependencies and every extra's, lower-cased."""
    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    return {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower() for spec in specs}


def imported_third_party(root: Path) -> dict[str, str]:
    """Each third-party top-level module imported under ``root``'s packages, with one file that imports it."""
    ours = set(PACKAGES)
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in ours and top not in sys.stdlib_module_names:
                        found.setdefault(top, str(path.relative_to(root)))
    return found


def undeclared(root: Path) -> list[str]:
    """The imports under ``root`` that no declared distribution provides, as 'module (file)'."""
    declared = declared_distributions(root / "pyproject.toml")
    return [f"{module} ({where})" for module, where in sorted(imported_third_party(root).items())
            if DISTRIBUTION_OF.get(module, module).lower() not in declared]


def test_every_imported_package_is_declared():
    assert undeclared(ROOT) == []


def test_an_undeclared_import_is_caught(tmp_path: Path):
    """The check on a copy of the manifest without tqdm, the import that once crashed a terminal run."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"tqdm[<>=]', text, flags=re.MULTILINE), "tqdm is declared"
    (tmp_path / "pyproject.toml").write_text(re.sub(r'^\s*"tqdm[^\n]*\n', "", text, flags=re.MULTILINE))
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "sim" / "bar.py").write_text("def draw():\n    from tqdm import tqdm\n    return tqdm\n")
    assert undeclared(tmp_path) == ["tqdm (sim/bar.py)"]
