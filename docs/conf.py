"""Sphinx configuration of cunorm's documentation site.

Build (strict: every warning, a broken reference included, fails):
    sphinx-build -W -n --keep-going -b html docs docs/_build/html
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "cunorm"
author = "the cunorm developers"
copyright = "2026, the cunorm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "bench/results.md"]
myst_heading_anchors = 3
html_theme = "alabaster"
html_title = "cunorm"
autodoc_member_order = "bysource"
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# The docstrings' parameter types are prose ("array", "int or tuple of int",
# "optional"): they are not references to resolve.
napoleon_preprocess_types = False
# The Returns sections name what they return (y, h, dx, dweight, dbias,
# mean, rstd): napoleon renders those names as types. pathlib.Path needs
# intersphinx, which the offline CI build cannot fetch.
nitpick_ignore_regex = [("py:class", r"(array|optional|int|float|bool|str|tuple|of|default.*|.*\d.*|None|"
                                     r"callable|dict|list|or|\{.*\}|[\"'].*|"
                                     r"y|h|dx|dh|dweight|dbias|mean|rstd|pathlib\.Path)")]
