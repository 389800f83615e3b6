"""Do the chapters' assertions hold on a busy machine? Run them beside another chapter.

    python launch/busy_check.py                        # 07 a0 02 05 06 10, five times each
    python launch/busy_check.py --repeats 1 07 10      # a quick try
    make busy-check N=1 CHAPTERS="07 10"

Each chapter runs ``--repeats`` times headless (``launch/batch.py``: QUICK, WORLD_SIZE 3, in
the strict device and point-to-point modes that ``make test``'s papermill runs use), while
another chapter's papermill run goes on beside it the whole time, started again whenever it
ends. That is the load that broke chapter 07's bubble check in ``make test``: another
chapter's ranks competing for the same cores in bursts (two plain CPU-bound processes beside
it did not). By default the run beside a chapter is the next chapter of the list (the last
one's is the first); ``--beside NAME`` runs one chapter beside them all.

A table of passes and failures comes at the end, with the first line of each failure. The
executed copies stay in ``out/busy_check/<chapter>/<run>/`` for the traceback. Exit code 1
if any checked run failed; a failure of the run beside does not count (it only makes load).
"""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH = ROOT / "launch" / "batch.py"
CHECKED = ("07", "a0", "02", "05", "06", "10")  # the chapters that time something and assert on it
SETTLE_S = 3  # before each checked run: the run beside is past its kernel's start, into its ranks
STRICT = {"ULTRASCALE_STRICT_DEVICE": "1", "ULTRASCALE_STRICT_P2P": "1"}  # as make test's papermill runs


def batch(chapter: str, out: pathlib.Path, world_size: int, env: dict) -> subprocess.Popen:
    """One papermill run of ``chapter`` through launch/batch.py, in a process group of its own
    (so that stopping it stops its kernel and ranks too)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "batch.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, str(BATCH), "--world-size", str(world_size), "--out", str(out), chapter],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen) -> None:
    """End a run started by :func:`batch` (its own process group only). An interrupt first:
    papermill then shuts its kernel down, which closes the kernel's ranks (the kernel runs in
    a session of its own, out of the group's reach); a kill if it has not ended in 30 s (the
    kernel then exits by itself once it sees its parent gone)."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


class Beside:
    """``chapter`` run again and again in the background until :meth:`close`."""

    def __init__(self, chapter: str, out: pathlib.Path, world_size: int, env: dict):
        self.chapter, self.out, self.world_size, self.env = chapter, out, world_size, env
        self.runs, self.failed = 0, []  # failed: the folders of the runs that failed, each kept
        self._done = threading.Event()
        self._proc = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._done.is_set():
            with self._lock:
                if self._done.is_set():
                    return
                folder = self.out / str(self.runs + 1)  # a folder per run: a failure's log is not overwritten
                self._proc = batch(self.chapter, folder, self.world_size, self.env)
            code = self._proc.wait()
            if not self._done.is_set():  # a run cut short by close() counts for nothing
                self.runs += 1
                self.failed += [folder] if code != 0 else []
            self._done.wait(1)  # a run beside that fails at once does not make this loop spin

    def close(self):
        with self._lock:
            self._done.set()
            if self._proc is not None:
                stop(self._proc)
        self._thread.join()


def status(out: pathlib.Path, code: int) -> str:
    """``ok`` or the failure's first line, from batch.py's table (out/batch.json)."""
    try:
        return json.loads((out / "batch.json").read_text())["runs"][0]["status"]
    except (OSError, ValueError, KeyError, IndexError):
        return "ok" if code == 0 else f"failed: batch.py exited {code} (see {out / 'batch.log'})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "chapters",
        nargs="*",
        default=list(CHECKED),
        metavar="CHAPTER",
        help=f"chapters to check (default: {' '.join(CHECKED)})",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each chapter (default 5)")
    parser.add_argument(
        "--beside", default=None, help="the chapter run beside every check (default: the next chapter of the list)"
    )
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "out" / "busy_check"))
    parser.add_argument("--no-strict", action="store_true", help="without the strict device and p2p modes")
    args = parser.parse_args(argv)
    if args.repeats < 1 or not args.chapters:
        parser.error("need at least one chapter and --repeats >= 1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({} if args.no_strict else STRICT)}
    out = pathlib.Path(args.out)
    rows = []
    for i, chapter in enumerate(args.chapters):
        beside_name = args.beside or args.chapters[(i + 1) % len(args.chapters)]
        if beside_name == chapter:  # one chapter alone on the list: something else beside it
            beside_name = "a0" if chapter != "a0" else "07"
        beside = Beside(beside_name, out / chapter / "beside", args.world_size, env)
        try:
            for run in range(1, args.repeats + 1):
                time.sleep(SETTLE_S)
                folder = out / chapter / str(run)
                start = time.monotonic()
                proc = batch(chapter, folder, args.world_size, env)
                try:
                    code = proc.wait()
                except KeyboardInterrupt:
                    stop(proc)
                    raise
                rows.append(
                    dict(
                        chapter=chapter,
                        run=run,
                        beside=beside_name,
                        seconds=time.monotonic() - start,
                        status=status(folder, code),
                    )
                )
                print(
                    f"{chapter:>4} run {run}/{args.repeats} beside {beside_name:<4} "
                    f"{rows[-1]['seconds']:6.1f} s  {rows[-1]['status']}",
                    flush=True,
                )
        finally:
            beside.close()
        failed = f": {', '.join(map(str, beside.failed))}" if beside.failed else ""
        print(
            f"     ({beside_name} ran {beside.runs} time(s) to the end beside it, {len(beside.failed)} failed{failed})",
            flush=True,
        )

    print(f"\n{'chapter':<8} {'passed':>6} {'failed':>6}   first failure")
    failed_any = False
    for chapter in args.chapters:
        mine = [r for r in rows if r["chapter"] == chapter]
        failures = [r for r in mine if r["status"] != "ok"]
        failed_any |= bool(failures)
        print(
            f"{chapter:<8} {len(mine) - len(failures):>6} {len(failures):>6}   "
            f"{failures[0]['status'][:100] if failures else ''}"
        )
    (out / "busy_check.json").write_text(json.dumps({"world_size": args.world_size, "runs": rows}, indent=1))
    print(
        f"{'FAIL' if failed_any else 'PASS'}: {len(rows)} runs, each beside another chapter's papermill run "
        f"(table in {out / 'busy_check.json'})"
    )
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
