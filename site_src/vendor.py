"""Refresh site_src/vendor/: the scripts the website needs, kept in the repository so that it
works offline (issue 54 item 5).

    python site_src/vendor.py          # fetch the pinned packages with npm, check, copy the files
    python site_src/vendor.py --check  # only check that vendor/ holds every file listed here

The pages of the site run three scripts that the default Sphinx and MyST-NB configuration
fetch from a CDN: RequireJS and the Jupyter widgets' HTML manager (which draws the saved
ipywidgets) and MathJax (which typesets the formulas). Offline, no widget renders and the
formulas stay raw TeX. Here each comes from its npm package, pinned by version and by the
registry's sha512 integrity of the tarball, and only the files a page loads are kept, with
the package's licence beside them (RequireJS's tarball has no licence file: its licence is
the header of require.js, kept as is; the HTML manager's is ipywidgets', the same
repository's, from the installed ipywidgets wheel). `make site` copies vendor/ into the
site's _static/ (conf.py) and never needs the network.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"

# package spec -> (sha512 integrity of its npm tarball, {file in the tarball: path under vendor/})
PACKAGES = {
    "requirejs@2.3.8": (
        "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
        {"package/require.js": "requirejs/require.js",
         "package/package.json": "requirejs/package.json"}),
    "@jupyter-widgets/html-manager@1.0.15": (
        "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
        {"package/dist/embed-amd.js": "html-manager/embed-amd.js",
         # the Font Awesome fonts its CSS names, woff2 only: the first format every current browser takes
         "package/dist/1551f4f60c37af51121f.woff2": "html-manager/1551f4f60c37af51121f.woff2",
         "package/dist/7a3337626410ca2f4071.woff2": "html-manager/7a3337626410ca2f4071.woff2",
         "package/dist/d878b0a6a1144760244f.woff2": "html-manager/d878b0a6a1144760244f.woff2",
         "package/dist/embed.js.LICENSE.txt": "html-manager/THIRD-PARTY-LICENSES.txt",
         "package/package.json": "html-manager/package.json"}),
    "mathjax@3.2.2": (
        "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
        {"package/es5/tex-chtml.js": "mathjax/es5/tex-chtml.js",
         **{f"package/es5/output/chtml/fonts/woff-v2/{font}": f"mathjax/es5/output/chtml/fonts/woff-v2/{font}"
            for font in ("MathJax_AMS-Regular.woff", "MathJax_Calligraphic-Bold.woff",
                         "MathJax_Calligraphic-Regular.woff", "MathJax_Fraktur-Bold.woff",
                         "MathJax_Fraktur-Regular.woff", "MathJax_Main-Bold.woff", "MathJax_Main-Italic.woff",
                         "MathJax_Main-Regular.woff", "MathJax_Math-BoldItalic.woff", "MathJax_Math-Italic.woff",
                         "MathJax_Math-Regular.woff", "MathJax_SansSerif-Bold.woff",
                         "MathJax_SansSerif-Italic.woff", "MathJax_SansSerif-Regular.woff",
                         "MathJax_Script-Regular.woff", "MathJax_Size1-Regular.woff", "MathJax_Size2-Regular.woff",
                         "MathJax_Size3-Regular.woff", "MathJax_Size4-Regular.woff",
                         "MathJax_Typewriter-Regular.woff", "MathJax_Vector-Bold.woff",
                         "MathJax_Vector-Regular.woff", "MathJax_Zero.woff")},
         "package/LICENSE": "mathjax/LICENSE",
         "package/package.json": "mathjax/package.json"}),
}
# Where each script is, relative to the site's _static/ (conf.py reads these).
REQUIRE_JS = "requirejs/require.js"
WIDGETS_JS = "html-manager/embed-amd.js"
MATHJAX_JS = "mathjax/es5/tex-chtml.js"


def listed() -> list[str]:
    return sorted(target for _, files in PACKAGES.values() for target in files.values()) + [
        "html-manager/LICENSE"]


def missing() -> list[str]:
    return [path for path in listed() if not (VENDOR / path).is_file()]


def fetch(spec: str, integrity: str, files: dict[str, str], work: Path) -> None:
    """npm pack the package, check the tarball's integrity, copy the listed files out of it."""
    done = subprocess.run(["npm", "pack", "--json", spec], cwd=work, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"npm pack {spec} failed:\n{done.stderr[-2000:]}")
    tarball = work / json.loads(done.stdout)[0]["filename"]
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if digest != integrity:
        raise SystemExit(f"{spec}: the tarball's integrity is {digest}, not the pinned {integrity}")
    with tarfile.open(tarball) as archive:
        for source, target in files.items():
            out = VENDOR / target
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(archive.extractfile(source).read())


def ipywidgets_licence() -> bytes:
    """The licence of the ipywidgets repository, which the HTML manager comes from."""
    from importlib.metadata import distribution
    files = [f for f in distribution("ipywidgets").files if f.name == "LICENSE"]
    if not files:
        raise SystemExit("the installed ipywidgets wheel has no LICENSE file")
    return files[0].locate().read_bytes()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every listed file is there")
    args = parser.parse_args(argv)
    if args.check:
        gone = missing()
        print("\n".join(f"missing: site_src/vendor/{path}" for path in gone) or f"{len(listed())} files present")
        return 1 if gone else 0
    if not shutil.which("npm"):
        raise SystemExit("npm is needed to refresh site_src/vendor/ (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (integrity, files) in PACKAGES.items():
            fetch(spec, integrity, files, Path(tmp))
            print(f"{spec}: {len(files)} files")
    (VENDOR / "html-manager" / "LICENSE").write_bytes(ipywidgets_licence())
    return 0


if __name__ == "__main__":
    sys.exit(main())
