"""One ``Cluster.run`` call, from the notebook's side: gather each rank's result,
error, printed lines and logged metrics until every rank has answered, the call
times out, a rank fails (the others then get a short grace period), or the stop
button is pressed. Messages tagged with an older job id are dropped, so a stopped
call can never leak its result into a later one."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from multiprocessing.connection import wait

import cloudpickle

from .errors import CallTimeout, RankError, RankFailure


class Call:
    """The bookkeeping of one ``Cluster.run``: results, errors, output and logs."""

    def __init__(self, cluster: Cluster, job_id: int, ranks, on_log, name: str):
        self.cluster, self.job_id, self.ranks = cluster, job_id, ranks
        self.on_log, self.name = on_log, name
        self.pending = set(ranks)
        self.results: dict = {}
        self.failures: dict = {}
        self.lines = defaultdict(list)

    def collect(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        give_up_at = None  # set when a rank fails: the rest get `grace` seconds
        try:
            while self.pending:
                now = time.monotonic()
                if now > deadline:
                    self._abandon()
                    raise self._error(CallTimeout, f"`{self.name}` did not finish within {timeout:g} s")
                if give_up_at is not None and now > give_up_at:
                    self._abandon()
                    break
                self._poll(min(0.05, deadline - now))
                if self.failures and give_up_at is None:
                    give_up_at = time.monotonic() + self.cluster.grace
        except KeyboardInterrupt:
            self._interrupt()
            raise
        finally:
            self._flush_output()
        if self.failures:
            raise self._error(RankError, f"{len(self.failures)} of {len(self.ranks)} ranks failed in `{self.name}`")
        return [self.results[r] for r in self.ranks]

    def _poll(self, timeout: float) -> None:
        cluster = self.cluster
        conns = {cluster._conns[r]: r for r in self.pending}
        sentinels = {cluster._procs[r].sentinel: r for r in self.pending}
        for ready in wait(list(conns) + list(sentinels), timeout=max(timeout, 0.0)):
            rank = conns.get(ready, sentinels.get(ready))
            try:
                conn = cluster._conns[rank]
                while rank in self.pending and conn.poll():
                    self._handle(*conn.recv())
            except EOFError:
                pass  # the pipe closed: the process is gone (handled below)
            proc = cluster._procs[rank]
            if rank in self.pending and not proc.is_alive():
                proc.join()
                self._fail(rank, RankFailure(rank, "died", f"the process exited with code {proc.exitcode}\n"))
                cluster._needs_restart = True

    def _handle(self, kind, job_id, rank, payload) -> None:
        if job_id not in (self.job_id, 0):
            return  # a stale message from an earlier, abandoned call
        if kind == "out":
            text = "".join(f"[rank {rank}] {line}" for line in payload[1].splitlines(keepends=True))
            if self.cluster.output == "live":
                (sys.stderr if payload[0] == "stderr" else sys.stdout).write(text)
            else:
                self.lines[rank].append((payload[0], text))
        elif kind == "log":
            if self.on_log is not None:
                self.on_log(rank, payload[1])
        elif kind == "result":
            self.results[rank] = cloudpickle.loads(payload)
            self.pending.discard(rank)
        elif kind == "error":
            type_name, tb, pickled = payload
            exc = _unpickle_or_none(pickled)
            self._fail(rank, RankFailure(rank, type_name, tb, exc))

    def _fail(self, rank: int, failure: RankFailure) -> None:
        self.failures[rank] = failure
        self.pending.discard(rank)

    def _abandon(self) -> None:
        """Ranks still running are stuck (or too slow): record their stacks, then
        kill them so that the next call starts on a fresh process group."""
        self.stuck = self.cluster._stacks(self.job_id, sorted(self.pending))
        self.cluster._kill()
        self.cluster._needs_restart = True

    def _interrupt(self, wait_s: float = 1.0) -> None:
        """The stop button: interrupt the ranks' Python code, kill those that don't stop."""
        cluster = self.cluster
        for rank in self.pending:
            cluster._conns[rank].send(("interrupt", self.job_id))
        deadline = time.monotonic() + wait_s
        try:
            while self.pending and time.monotonic() < deadline:
                self._poll(0.05)
        except KeyboardInterrupt:
            pass  # pressed twice: stop waiting
        if self.pending:  # blocked in C (a collective, a sleep): only a kill frees them
            cluster._kill()
            cluster._needs_restart = True
            print(f"[ultrascale] ranks {sorted(self.pending)} did not stop; all ranks will be restarted on the next call")

    def _error(self, cls, summary: str):
        stuck = getattr(self, "stuck", {})
        if stuck:
            summary += f"; ranks {sorted(stuck)} were stopped and the cluster restarts on the next call (ctx.state is lost)"
        return cls(summary, self.failures, stuck)

    def _flush_output(self) -> None:
        for rank in sorted(self.lines):
            for stream, text in self.lines[rank]:
                (sys.stderr if stream == "stderr" else sys.stdout).write(text)
        self.lines.clear()
        sys.stdout.flush()


def _unpickle_or_none(data):
    if data is None:
        return None
    try:
        return cloudpickle.loads(data)
    except Exception:
        return None
