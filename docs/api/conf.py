"""Sphinx configuration of zerofn's API reference (docs/api).

Build it from the repository root, warnings as errors::

    python3 -m sphinx -W --keep-going -b html docs/api docs/api/_build/html

Every name in the ``__all__`` of the modules below is documented: each page holds one
``public-names`` directive (``_ext/zerofn_public.py``), which reads ``__all__`` when the
reference is built, and a public name without a docstring fails the build.
"""
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE / "_ext")]     # this checkout's zerofn, with zerofn._C built

project = "zerofn"
author = "zerofn's authors"
copyright = "zerofn's authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "zerofn_public"]

# The modules whose public names the reference covers, in the order an object exported by
# several of them is documented: fully at its first name, as a pointer at the others.
zerofn_public_modules = ["zerofn", "zerofn.deepspeed", "zerofn.optim", "zerofn.integrations"]

# Google style (Args:, Returns:, Raises:, Example:) as zerofn's docstrings are written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# zerofn's transforms list their keyword options under "Options:", and DeepSpeedSettings its
# fields under "Fields:": both laid out as "Args:" is.
napoleon_custom_sections = [("Options", "params_style"), ("Fields", "params_style")]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# A method overriding torch's or transformers' without a docstring of its own is left out
# rather than shown with theirs (whose markup is not ours to keep warning-free).
autodoc_inherit_docstrings = False
autoclass_content = "both"       # the class docstring and __init__'s, where it has one

html_theme = "furo"
html_title = "zerofn API reference"
exclude_patterns = ["_build"]
