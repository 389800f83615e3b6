"""`make lab` opens on the course: launch/lab.sh started headless on a free localhost port.

Checks over HTTP (no browser) that the URL it prints leads to chapter 00, that the file
browser's listing of chapters/ holds each chapter once (the jupytext .py twins hidden, still
on disk), that library .py files still show, and that the notebooks' kernel "python3" is
.venv's Python under the display name their metadata carry.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
from warm_kernels import learners_env

pytest.importorskip("jupyterlab")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
LANDING = "/lab/tree/work/chapters/00_orientation.ipynb"  # the learner's own copy (ultrascale.workspace)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not (ROOT / ".venv/bin/jupyter").exists(), reason="no .venv (make setup)"),
    pytest.mark.skipif(sys.platform == "win32", reason="launch/lab.sh is a bash script"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    port = _free_port()
    env = dict(
        os.environ,
        HEADLESS="1",
        LAB_IP="127.0.0.1",
        LAB_PORT=str(port),
        LAB_SETUP="0",
        JUPYTER_RUNTIME_DIR=str(tmp_path_factory.mktemp("runtime")),
    )
    env = learners_env(env)  # the course's own kernelspec, as a learner's lab has it (tests/warm_kernels.py)
    proc = subprocess.Popen(
        ["bash", "launch/lab.sh"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, found = [], threading.Event()
    pattern = re.compile(rf"http://127\.0\.0\.1:{port}/\S+")

    def read():
        for line in proc.stdout:
            lines.append(line)
            if pattern.search(line):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(30) or proc.poll() is not None:
            pytest.fail("lab.sh printed no URL:\n" + "".join(lines[-40:]))
        url = next(pattern.search(line).group(0) for line in lines if pattern.search(line))
        deadline = time.monotonic() + 20  # the URL can be printed just before the port answers
        while True:
            try:
                _api(url, "/api/status")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url, lines
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _api(url: str, path: str):
    parts = urllib.parse.urlsplit(url)
    token = urllib.parse.parse_qs(parts.query)["token"][0]
    with urllib.request.urlopen(f"{parts.scheme}://{parts.netloc}{path}?token={token}", timeout=10) as r:
        return r.geturl(), r.read()


def test_printed_url_opens_chapter_00(lab):
    url, lines = lab
    parts = urllib.parse.urlsplit(url)
    assert parts.path == LANDING, url
    assert urllib.parse.parse_qs(parts.query).get("token"), "the printed URL carries no token"
    final, _ = _api(url, "/")  # the bare server address redirects there too
    assert urllib.parse.urlsplit(final).path == LANDING
    if os.getuid() == 0:
        assert any("--allow-root" in line for line in lines[:5]), "running as root without a word about it"


def test_each_chapter_listed_once(lab):
    url, _ = lab
    listing = json.loads(_api(url, "/api/contents/chapters")[1])
    names = [item["name"] for item in listing["content"]]
    assert len(names) == len(set(names))
    twins = [p for p in sorted(CHAPTERS.glob("*.py")) if p.with_suffix(".ipynb").exists()]
    assert twins, "no chapter twins found"
    for source in twins:
        assert source.with_suffix(".ipynb").name in names
        assert source.name not in names, f"{source.name} (the jupytext source) shows in the file browser"
        # hidden from the listing only: the source still opens by path
        model = json.loads(_api(url, f"/api/contents/chapters/{source.name}")[1])
        assert model["name"] == source.name


def test_library_files_still_listed(lab):
    url, _ = lab
    listing = json.loads(_api(url, "/api/contents/lib/ultrascale")[1])
    names = {item["name"] for item in listing["content"]}
    expected = {p.name for p in (ROOT / "lib/ultrascale").glob("*.py")}
    assert expected and expected <= names, expected - names


def test_notebooks_kernel_is_the_course_venv(lab):
    url, _ = lab
    specs = json.loads(_api(url, "/api/kernelspecs")[1])
    metadata = json.loads((CHAPTERS / "00_orientation.ipynb").read_text())["metadata"]["kernelspec"]
    assert metadata["name"] == specs["default"] == "python3"
    spec = specs["kernelspecs"]["python3"]["spec"]
    python = spec["argv"][0]
    # "python" alone means the server's own interpreter (jupyter_client), here .venv's
    assert python in ("python", "python3") or pathlib.Path(python).parent == ROOT / ".venv/bin", python
    assert spec["display_name"] == metadata["display_name"], (
        "the kernel's display name differs from the notebooks' metadata, so JupyterLab marks every "
        "notebook modified on opening: run `make setup` (launch/setup.sh registers it)"
    )


def test_one_kernel_to_choose(lab):
    url, _ = lab
    specs = json.loads(_api(url, "/api/kernelspecs")[1])
    assert set(specs["kernelspecs"]) == {"python3"}, sorted(specs["kernelspecs"])


def test_no_news_pop_up_and_no_update_check(lab):
    url, _ = lab
    settings = json.loads(_api(url, "/lab/api/settings/@jupyterlab/apputils-extension:notification")[1])
    defaults = {name: p["default"] for name, p in settings["schema"]["properties"].items()}
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults


def test_closing_a_notebook_shuts_its_kernel_down(lab):
    """Issue 54: each chapter's kernel and fork server hold about half a GB; closing the tab must
    give it back (JupyterLab's default keeps the kernel). tests/test_browser.py measures it."""
    url, _ = lab
    settings = json.loads(_api(url, "/lab/api/settings/@jupyterlab/notebook-extension:tracker")[1])
    assert settings["schema"]["properties"]["kernelShutdown"]["default"] is True
    assert settings["settings"].get("kernelShutdown", True) is True, settings["settings"]


def test_landing_page_is_the_learners_copy_and_saving_it_leaves_the_course_alone(lab):
    """launch/lab.sh made work/ (ultrascale.workspace): a save there changes no tracked notebook."""
    url, _ = lab
    course = (CHAPTERS / "00_orientation.ipynb").read_bytes()
    model = json.loads(_api(url, "/api/contents/work/chapters/00_orientation.ipynb")[1])
    assert model["type"] == "notebook"
    parts = urllib.parse.urlsplit(url)
    token = urllib.parse.parse_qs(parts.query)["token"][0]
    body = json.dumps({"type": "notebook", "format": "json", "content": model["content"]}).encode()
    request = urllib.request.Request(
        f"{parts.scheme}://{parts.netloc}/api/contents/work/chapters/00_orientation.ipynb?token={token}",
        data=body,
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status in (200, 201)
    assert (CHAPTERS / "00_orientation.ipynb").read_bytes() == course
    ignored = subprocess.run(["git", "check-ignore", "-q", "work/chapters/00_orientation.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0, "work/ is not ignored by git"
