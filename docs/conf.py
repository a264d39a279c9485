"""The documentation site's configuration (Sphinx): ``python -m sphinx -W --keep-going -b html docs site``.

Why Sphinx: the code's docstrings already cross-reference with Sphinx's roles (``:class:``, ``:meth:``, ``:func:``,
``:mod:``) and use the Google-style sections Napoleon reads, so the API reference is the docstrings as written; the
pages are Markdown (MyST), as the rest of the docs; ``-W`` turns every broken link, unknown reference target and
malformed docstring into a failed build, which is what the tests run (``tests/docs/test_site.py``).

Two references are generated at build time, never written by hand: the command-line reference from the argument
parsers (``docs/_ext/cli_reference.py``) and one API page per package from the docstrings
(``docs/_ext/api_pages.py``). Both write under ``docs/reference/generated/`` (ignored by git).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

project = "pipedejavu"
author = "the pipedejavu developers"
copyright = "2026, the pipedejavu developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "cli_reference",
    "api_pages",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# Experiment outputs written beside the pages (their data, not pages), and the build's own output.
exclude_patterns = ["_build", "results/**", "_ext/**"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = "pipedejavu"
html_static_path: list[str] = []

# Functions and classes are not entries of the table of contents (every page's navigation would list them all).
toc_object_entries = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# A module's own members only: names it imports (and lists in __all__) are documented where they are defined.
autodoc_default_options = {"members": True, "show-inheritance": False, "ignore-module-all": True}
# torch is optional for the simulator: the executor's pages import it, and a site built without it still builds.
autodoc_mock_imports = ["torch"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False


def _escape_absolute_values(app, what, name, obj, options, lines: list[str]) -> None:
    """Docstrings write an absolute value as ``|x|`` (``|error|``), which reStructuredText reads as a substitution
    reference: escape such bars outside inline literals so that they print as written."""
    for index, line in enumerate(lines):
        parts = line.split("``")
        # Even parts are outside ``literals``; a bar there is text, never markup, in this code base's docstrings.
        lines[index] = "``".join(part.replace("|", "\\|") if i % 2 == 0 else part for i, part in enumerate(parts))


def setup(app) -> None:
    """Sphinx hook: the docstring filter above."""
    app.connect("autodoc-process-docstring", _escape_absolute_values)
