"""One ``Cluster.run`` call, from the notebook's side: send the job, then gather each
rank's result, error, printed lines and logged metrics until every rank has answered,
the call times out, a rank fails (the others then get a short grace period), or the
stop button is pressed.

Nothing of a call may reach a later one:

* messages tagged with an older job id are dropped, so a stopped call's result or
  output never shows up in a later call;
* an exception while bytes move through a rank's pipe (the stop button in the middle
  of sending a large argument or receiving a large result, a pipe that breaks) leaves
  that pipe in an unknown state: the ranks are killed and restarted on the next call;
* a stopped or failed call that had used a process group may have left an operation
  behind (an ``isend`` nobody received, a collective only some ranks posted) that a
  later call's would pair with. Each rank reports whether its group sequence numbers
  moved during the call; if any did, the ranks are restarted on the next call. If
  none did, nothing was posted, and the ranks keep their ``ctx.state``.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from multiprocessing.connection import wait

import cloudpickle

from .errors import CallTimeout, RankError, RankFailure, Stopped
from .pipe import read_message

# The last line of a peer's error when the rank it was talking to died in a collective.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET")


class Call:
    """The bookkeeping of one ``Cluster.run``: results, errors, output and logs."""

    def __init__(self, cluster, job_id: int, ranks, on_log, name: str, presses=lambda: 0):
        self.cluster, self.job_id, self.ranks = cluster, job_id, ranks
        self.on_log, self.name = on_log, name
        self.presses = presses  # stop presses since the call began (stop_button.counting_presses)
        self.pending = set(ranks)
        self.results: dict = {}
        self.failures: dict = {}
        self.stuck: dict = {}
        self.used: set = set()  # ranks whose group sequence numbers moved during the call
        self.lost = False  # the ranks were killed during the call; restart on the next
        self.lines = defaultdict(list)

    # ---- sending ------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """Hand the job to every rank. Interrupted half-way, some ranks have the job and one
        has half a message: the only safe way on is to start all ranks afresh."""
        try:
            for rank in self.ranks:
                self.cluster._conns[rank].send(("run", self.job_id, payload))
        except KeyboardInterrupt:
            self._lose("stopped while the call was being sent to the ranks")
            raise
        except BaseException as err:
            self._lose(f"sending the call to the ranks failed ({type(err).__name__}: {err})")
            raise RuntimeError(
                f"`{self.name}` could not be sent to the ranks ({type(err).__name__}: "
                f"{err}); they restart on the next call"
            ) from err

    # ---- collecting ---------------------------------------------------------------
    def collect(self, timeout: float) -> list:
        try:
            timed_out = self._wait(time.monotonic() + timeout)
        except KeyboardInterrupt as stop:  # the stop button
            outcome = self._interrupt()
            if isinstance(stop, Stopped):
                raise
            raise Stopped(f"`{self.name}` stopped: {outcome}") from stop
        except BaseException:  # an exception in the on_log callback
            self._interrupt()
            raise
        finally:
            self._flush_output()
        if timed_out:
            raise self._error(CallTimeout, f"`{self.name}` did not finish within {timeout:g} s")
        if self.failures:
            raise self._error(RankError, self._summary())
        return [self.results[r] for r in self.ranks]

    def _wait(self, deadline: float) -> bool:
        """Gather answers until every rank has answered; True if the deadline passed."""
        give_up_at = None  # set when a rank fails: the rest get `grace` seconds
        while self.pending and not self.lost:
            if self.presses():  # stop was pressed, but its KeyboardInterrupt never reached us
                raise KeyboardInterrupt
            now = time.monotonic()
            if now > deadline:
                self._abandon()
                return True
            if give_up_at is not None and now > give_up_at:
                self._abandon()
                break
            self._poll(min(0.05, deadline - now))
            if self.failures and give_up_at is None:
                give_up_at = time.monotonic() + self.cluster.grace
        return False

    def _poll(self, timeout: float) -> None:
        cluster = self.cluster
        conns = {cluster._conns[r]: r for r in self.pending}
        sentinels = {cluster._procs[r].sentinel: r for r in self.pending}
        for ready in wait(list(conns) + list(sentinels), timeout=max(timeout, 0.0)):
            rank = conns.get(ready, sentinels.get(ready))
            if rank not in self.pending:
                continue  # answered through its other handle in this round
            self._drain(rank)
            if self.lost:
                return
            proc = cluster._procs[rank]
            if rank in self.pending and not proc.is_alive():
                proc.join()
                self._fail(rank, RankFailure(rank, "died", f"the process exited with code {proc.exitcode}\n"))
                cluster._needs_restart = True

    def _drain(self, rank: int) -> None:
        conn = self.cluster._conns[rank]
        while rank in self.pending and conn.poll():
            message = self._read(rank)
            if message is None:
                return  # the pipe closed: the process is gone (the caller sees it)
            self._handle(*message)

    def _read(self, rank: int):
        """One message from ``rank``; any exception on the way ends every pipe."""
        try:
            return read_message(self.cluster._conns[rank])
        except EOFError:
            return None
        except KeyboardInterrupt:
            self._lose(f"stopped while a message from rank {rank} was arriving")
            raise
        except BaseException as err:
            self._lose(f"the pipe to rank {rank} broke ({type(err).__name__}: {err})")
            raise RuntimeError(
                f"`{self.name}`: the pipe to rank {rank} broke ({type(err).__name__}: {err}); "
                "all ranks restart on the next call (ctx.state is lost)"
            ) from err

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
        elif kind in ("result", "error"):
            body, used = payload
            if used:
                self.used.add(rank)
            self.pending.discard(rank)  # it has answered, whatever becomes of the answer here
            if kind == "result":
                self._unpickle_result(rank, body)
            else:
                type_name, tb, pickled = body
                self._fail(rank, RankFailure(rank, type_name, tb, _unpickle_or_none(pickled)))

    def _unpickle_result(self, rank: int, data: bytes) -> None:
        try:
            self.results[rank] = cloudpickle.loads(data)
        except Exception as err:  # e.g. a class the notebook cannot import
            self._fail(
                rank,
                RankFailure(
                    rank,
                    type(err).__name__,
                    f"rank {rank} returned a result the notebook cannot unpickle: {type(err).__name__}: {err}\n"
                    "Return tensors, numbers, containers of them, or objects of classes defined in the "
                    "notebook or in a module the notebook can import.\n",
                    err,
                ),
            )

    def _fail(self, rank: int, failure: RankFailure) -> None:
        self.failures[rank] = failure
        self.pending.discard(rank)

    # ---- ending early -------------------------------------------------------------
    def _lose(self, reason: str | None = None) -> None:
        """Kill the ranks now; the next call starts new ones (and a new process group)."""
        self.lost = True
        self.cluster._lose()
        if reason:
            print(f"[ultrascale] {reason}: all ranks restart on the next call (ctx.state is lost)")

    def _abandon(self) -> None:
        """Ranks still running are stuck (or too slow): record their stacks, then
        kill them so that the next call starts on a fresh process group."""
        try:
            self.stuck = self.cluster._stacks(self.job_id, sorted(self.pending))
        finally:
            self._lose()

    def _interrupt(self, wait_s: float = 1.0) -> str:
        """The stop button: interrupt the ranks' Python code, kill those that don't stop,
        and restart them all if the call had used a process group. Returns what happened to
        the ranks, for the one line the learner sees."""
        restarted = "all ranks were stopped and start afresh on the next call (ctx.state is lost)"
        if self.lost:
            return restarted
        try:
            for rank in sorted(self.pending):
                self.cluster._conns[rank].send(("interrupt", self.job_id))
            deadline = time.monotonic() + wait_s
            while self.pending and not self.lost and time.monotonic() < deadline:
                self._poll(0.05)
        except KeyboardInterrupt:
            pass  # pressed twice: stop waiting
        except Exception as err:  # a pipe that broke while stopping
            if not self.lost:
                self._lose(f"a pipe broke while stopping the ranks ({type(err).__name__})")
        if self.lost:
            return restarted
        # Each reason is said once, in the Stopped exception's line (not printed here as well).
        if self.pending:  # blocked in C (a collective, a sleep): only a kill frees them
            blocked = sorted(self.pending)
            self._lose()
            return f"{restarted}; ranks {blocked} were blocked outside Python (e.g. in a collective)"
        if self.cluster._needs_restart:
            self._lose()
            return f"{restarted}; a rank died during the call"
        if self.used:
            self._lose()
            return f"{restarted}; the call had posted collectives, which must not pair with a later call's"
        return "the ranks stopped before using the process group and keep their state (ctx.state)"

    # ---- reporting ----------------------------------------------------------------
    def _summary(self) -> str:
        """How many ranks failed; peers that only lost their connection to a dead rank
        (gloo's "Connection closed by peer") are named apart, not counted."""
        died = sorted(r for r, f in self.failures.items() if f.type_name == "died")
        followers = sorted(r for r, f in self.failures.items() if died and r not in died and _lost_a_peer(f))
        text = f"{len(self.failures) - len(followers)} of {len(self.ranks)} ranks failed in `{self.name}`"
        if died:
            text += f" (rank{'s' if len(died) > 1 else ''} {', '.join(map(str, died))} died)"
        if followers:
            text += f"; ranks {followers} then lost their connection to it in a collective"
        return text

    def _aftermath(self) -> str:
        """What became of the ranks, for the error message."""
        if self.stuck:
            return (
                f"; ranks {sorted(self.stuck)} were stopped and the cluster restarts on the next call "
                "(ctx.state is lost)"
            )
        if self.lost or self.cluster._needs_restart:
            return "; all ranks restart on the next call (ctx.state is lost)"
        if self.used:
            self._lose()
            return (
                f"; the call had used the process group (ranks {sorted(self.used)} posted collectives or "
                "sends), so all ranks restart on the next call (ctx.state is lost): nothing it left "
                "unmatched can reach a later call"
            )
        return "; no rank had used the process group, so the ranks keep their state"

    def _error(self, cls, summary: str):
        return cls(summary + self._aftermath(), self.failures, self.stuck)

    def _flush_output(self) -> None:
        for rank in sorted(self.lines):
            for stream, text in self.lines[rank]:
                (sys.stderr if stream == "stderr" else sys.stdout).write(text)
        self.lines.clear()
        sys.stdout.flush()


def _lost_a_peer(failure: RankFailure) -> bool:
    lines = failure.traceback.strip().splitlines()
    return bool(lines) and any(marker in lines[-1] for marker in _PEER_LOST)


def _unpickle_or_none(data):
    if data is None:
        return None
    try:
        return cloudpickle.loads(data)
    except Exception:
        return None
