"""Heading anchors as Jupyter makes them, for MyST (conf.py's ``myst_heading_slug_func``).

The exercise notebooks link to sections of their chapter the way JupyterLab and nbviewer
name them: the heading's text with each space replaced by ``-``, e.g.
``../chapters/02_data_parallelism.ipynb#3.-Bucketing:-a-few-big-messages-instead-of-many-small-ones``.
Giving every heading that same anchor on the website makes those links land on the section
there too (MyST's default, GitHub's lower-case slugs, would leave them dangling).
"""


def slug(title: str) -> str:
    return title.strip().replace(" ", "-")
