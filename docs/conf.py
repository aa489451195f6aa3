"""Sphinx configuration: the API reference is generated from the docstrings (offline)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "kfac_jax"
author = "kfac_jax developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
exclude_patterns = ["_build"]
# A wider text column for the code blocks, and a scroll bar on those still wider than it.
html_theme_options = {"page_width": "1120px", "body_max_width": "900px"}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
