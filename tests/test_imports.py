"""The import rules of DESIGN §2: sim never imports torch; matplotlib only when a chart is drawn."""

import subprocess
import sys
from pathlib import Path

import sim

SIM_MODULES = sorted(
    "sim." + ".".join(path.relative_to(Path(sim.__file__).parent).with_suffix("").parts)
    for path in Path(sim.__file__).parent.rglob("*.py")
    if path.name != "__init__.py"
)


def _loaded_after_import(modules):
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_every_sim_module_is_found():
    assert {"sim.engine", "sim.ir", "sim.run", "sim.viz.gantt", "sim.topology"} <= set(SIM_MODULES)


def test_sim_never_imports_torch_and_imports_matplotlib_lazily():
    loaded = _loaded_after_import(SIM_MODULES)
    assert "torch" not in loaded
    assert "matplotlib" not in loaded
