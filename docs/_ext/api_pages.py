"""The API reference, one page per package, written from the package tree when the site builds.

Each page holds an ``automodule`` directive per module of its package, so the reference is the docstrings as they
are in the code; a module added to a package is on its page the next time the site builds. Pages go to
``reference/generated/api/`` (ignored by git), listed by ``reference/api.md``.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

__all__ = ["PACKAGES", "modules_of", "render_package", "write_pages"]

#: The top-level packages documented.
PACKAGES = ("sim", "executor", "profiles", "experiments")


def modules_of(package: str) -> tuple[list[str], list[str]]:
    """``(modules, subpackages)`` directly inside ``package`` (by import name), sorted; ``__main__`` entry points
    are left out (they hold no API)."""
    root = Path(__file__).resolve().parents[2] / package.replace(".", "/")
    modules, packages = [], []
    for info in pkgutil.iter_modules([str(root)]):
        if info.name == "__main__":
            continue
        (packages if info.ispkg else modules).append(f"{package}.{info.name}")
    return sorted(modules), sorted(packages)


def all_packages() -> list[str]:
    """Every package under :data:`PACKAGES`, depth first."""
    found = []
    pending = list(PACKAGES)
    while pending:
        package = pending.pop(0)
        found.append(package)
        pending[:0] = modules_of(package)[1]
    return found


def render_package(package: str) -> str:
    """The Markdown page of ``package``: its own docstring, then each module's."""
    modules, _ = modules_of(package)
    lines = [f"# `{package}`", "", "```{eval-rst}", f".. automodule:: {package}", "   :no-members:", "```", ""]
    for module in modules:
        lines += [f"## `{module}`", "", "```{eval-rst}", f".. automodule:: {module}", "```", ""]
    return "\n".join(lines)


def write_pages(folder: Path) -> list[str]:
    """Write one page per package into ``folder`` (only those whose text changed), remove pages of packages that
    are gone; the page names written."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for package in all_packages():
        path = folder / f"{package}.md"
        text = render_package(package)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        names.append(path.name)
    for stale in folder.glob("*.md"):
        if stale.name not in names:
            stale.unlink()
    return names


def setup(app) -> dict:
    """Sphinx hook: write the pages before the sources are read."""
    app.connect("builder-inited",
                lambda app: write_pages(Path(app.srcdir) / "reference" / "generated" / "api"))
    return {"parallel_read_safe": True, "version": "1"}
