"""The torch range the course supports: checked at import, stated where users read it, and the
same number in the library, the README and `make test-compat`."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ultrascale
from ultrascale import SUPPORTED_TORCH, check_torch_version

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.2"])
def test_a_supported_torch_is_accepted_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.14.1", "2.15.0+cu128", "3.0.0"])
def test_a_newer_torch_warns_and_says_what_to_do(version):
    with pytest.warns(
        UserWarning, match=rf"tested with torch 2\.11 to 2\.13; this Python has torch {re.escape(version)}"
    ):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.9.1+cu126", "1.13.1"])
def test_an_older_torch_is_refused_with_what_to_do(version):
    with pytest.raises(
        ImportError, match=rf"needs torch 2\.11 to 2\.13; this Python has torch {re.escape(version)}.*make setup"
    ):
        check_torch_version(version)


def test_the_installed_torch_is_read_without_importing_it():
    """Importing the library reads torch's version from its version.py, not by importing torch
    (which the runtime starts importing on another core first; see runtime/__init__.py)."""
    code = (
        "import sys, ultrascale; assert 'torch' not in sys.modules, 'torch imported';"
        "import torch; assert ultrascale._installed_torch() == torch.__version__"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_range_is_the_same_in_the_readme_and_the_makefile():
    oldest, newest = SUPPORTED_TORCH
    readme = (REPO / "README.md").read_text()
    assert f"torch {oldest} to {newest}" in readme
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^TORCH_OLDEST := {re.escape(oldest)}\.\d+$", makefile, re.MULTILINE)
    setup = (REPO / "launch" / "setup.sh").read_text()
    assert re.search(rf"TORCH_VERSION:-{re.escape(newest)}\.\d+", setup)
    assert ultrascale.__version__
