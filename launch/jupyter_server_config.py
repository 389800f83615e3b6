# JupyterLab settings for the course (launch/lab.sh passes this file with --config).
# The server's root is the repository; these settings only change what the learner sees.
c = get_config()  # noqa: F821 (defined by Jupyter when it loads this file)

# Open on the course's landing page, not the bare launcher: the learner's own copy of it in
# work/ (launch/lab.sh makes the copies first, lib/ultrascale/workspace.py), so that running and
# saving never changes a tracked notebook. This is also the URL that the server prints
# (http://HOST:PORT/lab/tree/work/chapters/00_orientation.ipynb?token=...).
c.LabApp.default_url = "/lab/tree/work/chapters/00_orientation.ipynb"

# Each chapter once in the file browser. chapters/NN_name.py and aN_name.py are the jupytext
# "percent" sources the .ipynb are built from (launch/build_notebooks.py); jupytext would list
# them as notebooks too, so every chapter appeared twice. They are only hidden from listings:
# they stay on disk, in git, and can still be opened by path. The patterns match file names
# only (Jupyter's hide_globs), so a .py of your own named like "01_x.py" is hidden as well.
c.ContentsManager.hide_globs = [
    # Jupyter's defaults
    "__pycache__",
    "*.pyc",
    "*.pyo",
    ".DS_Store",
    "*.so",
    "*.dylib",
    "*~",
    # the chapters' jupytext twins
    "[0-9][0-9]_*.py",
    "a[0-9]_*.py",
]

# The notebooks' kernel is "python3" (their metadata). A lab started from .venv finds
# .venv/share/jupyter/kernels/python3 first (lab.sh sets JUPYTER_PREFER_ENV_PATH=1), which
# launch/setup.sh registers for .venv's Python: the course's own interpreter, shown as
# "Python 3" like the notebooks' metadata (another name would mark them modified on opening).
# New notebooks get the same kernel.
c.MappingKernelManager.default_kernel_name = "python3"

# One kernel to choose from: the course's. setup.sh also registers "ultrascale (.venv)" in the
# user's Jupyter folder, for other front ends (VS Code, a system-wide Jupyter); in the course's
# own lab a second entry for the same Python only makes the launcher ask which one.
c.KernelSpecManager.allowed_kernelspecs = {"python3"}

# No "Jupyter news" pop-up over the first notebook, and no request to a news feed or for
# updates: the settings' defaults are replaced by launch/lab_settings/overrides.json (a learner
# can still change them in Settings).
# The same file turns on "Shut down kernel" when a notebook's last tab closes (the notebook
# tracker's kernelShutdown): a chapter's kernel and its ranks' fork server, both with torch
# loaded, hold about half a GB, and JupyterLab's default kept them until the lab stopped, so a
# learner who had visited five chapters held 2-3 GB. The kernel's exit takes its fork server
# and ranks with it (ultrascale.runtime: the server sees its kernel's pipe close, the ranks
# watch the kernel's process).
import os  # noqa: E402

c.LabApp.app_settings_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab_settings")

# No check for a rebuild of JupyterLab at each load of the page, and no Build button. The course's
# extensions come built with their pip packages, so a build is never needed; the check ran node
# twice (yarn.js config, node-version-check.js) and read every extension's package.json, on every
# load of the page: in the browser tests, 38 node processes and about a second of the server's
# CPU per page.
c.ServerApp.tornado_settings = {"page_config_data": {"buildCheck": False, "buildAvailable": False}}
