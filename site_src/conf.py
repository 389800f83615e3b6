"""Sphinx configuration of the course's website (`make site`; site_src/build.py runs Sphinx).

The notebooks are rendered from their saved outputs (nothing is executed): MyST-NB turns
matplotlib PNGs into images and ipywidgets into views restored from the widget state saved in
each notebook's metadata. site_src/build.py assembles the source folder (site/src) from
chapters/, exercises/, results/ and README.md and builds with -W --keep-going, so a broken
internal link or a missing image fails the build.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vendor  # noqa: E402  (site_src/vendor.py: the scripts kept in site_src/vendor/)

project = "ultrascale"
author = "the ultrascale course"
copyright = "the ultrascale course"

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "**/*.updated.ipynb"]

# Render what is saved; never start a kernel.
nb_execution_mode = "off"
nb_merge_streams = True          # a cell's stdout chunks shown as one block, as in JupyterLab

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 4
# JupyterLab's anchors (heading text, spaces -> "-"), which the exercise notebooks link to.
myst_heading_slug_func = "jupyter_anchors.slug"

html_theme = "sphinx_book_theme"
html_title = "ultrascale: the Ultra-Scale Playbook, run"
html_theme_options = {
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,   # the .ipynb, to open in JupyterLab
    "home_page_in_toc": True,
}
html_last_updated_fmt = None

# Offline: RequireJS, the widgets' HTML manager and MathJax from site_src/vendor/ (copied into
# _static/), not from a CDN (site_src/vendor.py says where they come from). MathJax 3, whose
# configuration MyST writes (mathjax3_config); its fonts sit beside it, where it looks for them.
# static/widgets_setup.js tells RequireJS where the widget manager's fonts are, and gives
# the widget manager the MathJax 2 call it typesets labels with.
html_static_path = ["vendor", "static"]
mathjax_path = vendor.MATHJAX_JS
nb_ipywidgets_js = {vendor.REQUIRE_JS: {}, "widgets_setup.js": {}, vendor.WIDGETS_JS: {}}
html_copy_source = True            # the notebooks themselves, downloadable from each page
html_show_sourcelink = False

suppress_warnings = [
    # "H1 to H3": a chapter skips a heading level (e.g. a "###" right under its "#" title). That is
    # the notebooks' style, which JupyterLab renders the same; not a broken link or image.
    "myst.header",
]
