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
