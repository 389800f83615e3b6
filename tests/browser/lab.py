"""The course's JupyterLab, a headless Chromium, and every process they start, for tests/test_browser.py.

* ``browser_paths()``: Debian's chromium and chromium-driver, installed with apt-get when they are
  missing and this process may (root, apt-get present); otherwise ``Unavailable`` says why. Selenium
  is always given both paths, so it never looks for, or downloads, a browser or driver of its own.
* ``CourseCopy``: the notebooks copied to a temporary folder (with ``launch/`` and a link to
  ``.venv``; committed in a git repository of its own, for ``git status``), so a learner's Run All, typing and autosave never touch the repository's notebooks.
* ``Lab``: ``launch/lab.sh`` of that copy, headless on a free localhost port with a token: the same
  script and settings as ``make lab``; its output goes to a log file (quoted if it fails to start).
* ``Processes``: every process the server and the browser start (kernels, the ranks' fork server
  and ranks, chromium's helpers), noted while they live, then stopped one by one by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from warm_kernels import learners_env

ROOT = Path(__file__).resolve().parents[2]
APT_PACKAGES = ["chromium", "chromium-driver"]  # Debian's names (Ubuntu's are snap wrappers)


class Unavailable(Exception):
    """The browser cannot be had here: the message says why (the tests skip with it)."""


# ---- the browser ------------------------------------------------------------------------


def _debian_paths() -> tuple[Path, Path]:
    return Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver): Debian's, installed with apt-get if missing and allowed."""
    browser, driver = _debian_paths()
    if browser.exists() and driver.exists():
        return str(browser), str(driver)
    missing = " and ".join(str(p) for p in (browser, driver) if not p.exists())
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{missing} missing and no apt-get here: install Debian's {' '.join(APT_PACKAGES)}")
    if os.geteuid() != 0:
        raise Unavailable(f"{missing} missing and not root: run `sudo apt-get install {' '.join(APT_PACKAGES)}`")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"`{' '.join(command)}` failed:\n{(done.stdout + done.stderr)[-1500:]}")
    if not (browser.exists() and driver.exists()):
        raise Unavailable(f"apt-get installed {APT_PACKAGES} but {browser} or {driver} is still missing")
    return str(browser), str(driver)


def chrome_options(browser: str, profile: Path, width: int = 1400, height: int = 1000):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # no sandbox: root in a container has none
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    return options


def start_browser(browser: str, driver: str, profile: Path, log: Path):
    """A headless Chromium driven by the given chromedriver (never one Selenium fetches)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, if ever reached, must not download
    service = Service(executable_path=driver, log_output=str(log))
    return webdriver.Chrome(service=service, options=chrome_options(browser, profile))


# ---- the course, copied ---------------------------------------------------------------


class CourseCopy:
    """chapters/, exercises/, results/ and launch/ copied to ``where``, .venv linked, committed in
    a git repository of its own (when git is there)."""

    def __init__(self, where: Path):
        self.root = where
        (where / "chapters").mkdir(parents=True)
        for source in sorted((ROOT / "chapters").glob("*")):
            if source.suffix in (".ipynb", ".py"):
                shutil.copy2(source, where / "chapters" / source.name)
        for folder in ("exercises", "results", "launch"):
            shutil.copytree(
                ROOT / folder, where / folder, ignore=shutil.ignore_patterns("*.updated.ipynb", ".ipynb_checkpoints")
            )
        (where / ".venv").symlink_to(ROOT / ".venv")
        # The learner's settings start from JupyterLab's defaults; only the news prompt is off
        # (it asks to reach the internet and covers the corner of every screenshot).
        notification = where / ".lab-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True)
        notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        # Every cell in the page from the start. The default ("contentVisibility") attaches cells
        # as they scroll into view, so a test could not find a cell further down by its index;
        # outputs and widgets render the same either way.
        tracker = where / ".lab-settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
        tracker.parent.mkdir(parents=True)
        tracker.write_text(json.dumps({"windowingMode": "none"}))
        self.git = self._commit()

    def _commit(self) -> bool:
        """Make the copy a git repository whose one commit holds the course's files (and its
        .gitignore), so a test can ask ``git status`` whether the lab changed a tracked file, as a
        learner would; False when git is missing."""
        if shutil.which("git") is None:
            return False
        shutil.copy2(ROOT / ".gitignore", self.root / ".gitignore")
        env = dict(
            os.environ,
            GIT_AUTHOR_NAME="course copy",
            GIT_AUTHOR_EMAIL="copy@localhost",
            GIT_COMMITTER_NAME="course copy",
            GIT_COMMITTER_EMAIL="copy@localhost",
        )
        for command in (
            ["init", "-q"],
            ["add", ".gitignore", "chapters", "exercises", "results", "launch"],
            ["-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", "the course, copied"],
        ):
            subprocess.run(["git", *command], cwd=self.root, env=env, check=True, capture_output=True, timeout=120)
        return True

    def git_status(self) -> list[str]:
        """``git status --porcelain`` of the copy, one line per changed or untracked (not ignored) path."""
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=self.root,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout.splitlines()

    def notebook(self, relative: str) -> dict:
        return json.loads((self.root / relative).read_text())


# ---- the server -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """launch/lab.sh of a CourseCopy, headless on 127.0.0.1:<free port>, with a token."""

    def __init__(self, course: CourseCopy, log: Path):
        self.course, self.log_path = course, log
        self.port, self.token = free_port(), os.urandom(12).hex()
        self.base = f"http://127.0.0.1:{self.port}"
        self._shutting_down: list[threading.Thread] = []
        env = dict(
            os.environ,
            HEADLESS="1",
            LAB_IP="127.0.0.1",
            LAB_PORT=str(self.port),
            LAB_SETUP="0",
            JUPYTER_TOKEN=self.token,
            JUPYTER_RUNTIME_DIR=str(course.root / ".runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(course.root / ".lab-settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(course.root / ".lab-workspaces"),
        )
        env.pop("MPLBACKEND", None)  # the kernels keep their inline backend (see launch/test.sh)
        env = learners_env(env)  # fresh kernels, the Lab's children, as a learner's are
        self._log = open(log, "w")
        # A session of its own: os.getsid() then names every process the server starts.
        self.process = subprocess.Popen(
            ["bash", "launch/lab.sh"],
            cwd=course.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90) -> float:
        start = time.monotonic()
        while True:
            try:
                self.api("GET", "/api/status")
                return time.monotonic() - start
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"launch/lab.sh exited ({self.process.returncode}):\n{self.log()[-3000:]}")
                if time.monotonic() - start > timeout:
                    raise RuntimeError(f"the lab did not answer in {timeout:.0f} s:\n{self.log()[-3000:]}")
                time.sleep(0.3)

    def url(self, path: str = "/lab") -> str:
        return f"{self.base}{path}{'&' if '?' in path else '?'}token={self.token}"

    def api(self, method: str, path: str):
        request = urllib.request.Request(
            f"{self.base}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernels(self) -> list:
        return self.api("GET", "/api/kernels")

    def shut_down_kernels(self, wait: bool = True) -> None:
        """Shut down the kernels running now; ``wait=False``: in a thread, while the tests go on
        (a kernel takes a few seconds to stop its ranks; ``join()`` waits for them)."""
        ids = [kernel["id"] for kernel in self.kernels()]

        def shut_down():
            for kernel in ids:
                try:
                    self.api("DELETE", f"/api/kernels/{kernel}")
                except OSError:
                    pass  # already gone; the final check of processes tells whether it stopped

        if wait:
            shut_down()
        else:
            thread = threading.Thread(target=shut_down, daemon=True)
            thread.start()
            self._shutting_down.append(thread)

    def join(self) -> None:
        for thread in self._shutting_down:
            thread.join(60)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20) -> None:
        """Stop the server by its PID (it shuts its kernels down first)."""
        self.join()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


# ---- every process they start -------------------------------------------------------------


class Processes:
    """Notes every descendant of some root processes (and every process of the server's
    session) while they live, so each can be checked, and stopped, by PID at the end.

    A kernel's ranks are forked by a fork server that the kernel started; a rank whose kernel
    died would be adopted by init and lost to a walk of children: noting them while they run
    (every ``every`` seconds, in a thread) keeps them on the list.
    """

    def __init__(self, every: float = 0.5):
        self.roots: list[int] = []
        self.sessions: list[int] = []
        self._session_roots: list[int] = []  # the root whose session each of ``sessions`` is
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (start time, command line)
        self.root_of: dict[int, int] = {}  # pid -> the root it was found under (the server's or the browser's)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        self._thread.start()

    def add_root(self, pid: int, session: bool = False) -> None:
        with self._lock:
            self.roots.append(pid)
            if session:
                self.sessions.append(os.getsid(pid))
                self._session_roots.append(pid)
        self.snapshot()

    def snapshot(self) -> None:
        found = []  # (process, the root it belongs to)
        with self._lock:
            roots, sessions = list(self.roots), dict(zip(self.sessions, self._session_roots))
        for pid in roots:
            try:
                root = psutil.Process(pid)
                found += [(p, pid) for p in (root, *root.children(recursive=True))]
            except psutil.Error:
                continue
        if sessions:
            for process in psutil.process_iter():
                try:
                    if (sid := os.getsid(process.pid)) in sessions:
                        found.append((process, sessions[sid]))
                except (OSError, psutil.Error):
                    continue
        for process, root in found:
            try:
                started, argv, name = process.create_time(), process.cmdline(), process.name()
                command = " ".join(argv)[:160]
                if argv and not os.path.basename(argv[0]).startswith(name):  # a fork that named itself:
                    command = f"{name}: {command}"  # "forkserver: python -m ipykernel_launcher ..."
            except psutil.Error:
                continue
            with self._lock:  # the latest command line: lab.sh's bash becomes jupyter-lab (exec)
                if self.seen.get(process.pid, (started,))[0] == started:
                    self.seen[process.pid] = (started, command)
                    self.root_of.setdefault(process.pid, root)

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            self.snapshot()

    def alive(self) -> dict[int, str]:
        """The noted processes still running (the same PID and start time, not a zombie)."""
        running = {}
        with self._lock:
            seen = dict(self.seen)
        for pid, (started, command) in seen.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                    running[pid] = command
            except psutil.Error:
                continue
        return running

    def under(self, root: int) -> dict[int, str]:
        """The noted processes of ``root`` still running: a kernel's fork server or rank whose
        kernel died (adopted by init) stays on the list, since it was noted while it ran."""
        self.snapshot()
        return {pid: command for pid, command in self.alive().items() if self.root_of.get(pid) == root}

    def private_mib(self, root: int) -> tuple[float, dict[int, str]]:
        """The private memory of ``root``'s processes, in MiB: the sum of their USS (pages that
        only that process maps; what the machine gets back when it exits), and who was counted,
        each as "NN MiB command". Shared pages (torch's libraries, mapped by a kernel and its fork
        server alike) are counted in no one's USS, so the sum never counts a page twice."""
        total, counted = 0, {}
        for pid, command in self.under(root).items():
            try:
                uss = psutil.Process(pid).memory_full_info().uss
            except psutil.Error:
                continue  # gone meanwhile
            total += uss
            # the interpreter's path said once as "python": a clone's path (/check/work/main/.venv/...)
            # must not push what the command runs past the cut
            command = command.replace(sys.executable, "python")
            counted[pid] = f"{uss / 2**20:.0f} MiB {command[:160]}"
        return total / 2**20, counted

    def stop_watching(self) -> None:
        self.snapshot()
        self._stop.set()
        self._thread.join()

    def kill(self, pids, timeout: float = 5) -> None:
        """SIGTERM each of ``pids``, then SIGKILL each one still there after ``timeout``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if pid in self.alive():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(pid in self.alive() for pid in pids):
                time.sleep(0.1)

    def wait_gone(self, timeout: float) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left
