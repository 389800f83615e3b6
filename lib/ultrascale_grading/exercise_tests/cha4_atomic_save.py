"""Tests of the A4 exercise on saving a checkpoint atomically
(solutions/a4_checkpoints_and_failures_exercises.ipynb); the other A4 exercises are tested in
``cha4.py``.

* ``a4.atomic_save``: ``save_atomically(root, step, tensor, group)``, called on every rank of a
  process group, writes each rank's tensor as ``rank<r>.pt`` (r: the rank within the group) into a
  temporary directory and has the group's first rank rename it to ``root/step-<step:08d>`` once
  every rank's file is written. Run on 3 ranks as the whole world and as ``[0]`` beside ``[1, 2]``
  (the group's first rank is global rank 1). The ranks are watched, not raced: the other ranks'
  writes are held back until the group's first rank has written its own file and entered a
  collective (or renamed, or returned), so a rename that does not wait for every rank always finds
  files missing. Named mistakes: files written under the final name, a rename before the others'
  files (no barrier, or one before the writes only), a collective over the world instead of the
  group, the global rank used for the file names or for choosing who renames, a copy instead of a
  rename, several ranks renaming, a temporary directory left behind.

While the learner's function runs, ``ultrascale.checkpoint.store``'s savers refuse to be called.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ultrascale.checkpoint import store
from ultrascale_grading.exercise_tests._groups import COLLECTIVES, Split
from ultrascale_grading import exercise
from ultrascale_grading.guards import swapped_dist_functions, without_library


# ---- a4.atomic_save ------------------------------------------------------------------------

FINAL = "step-{:08d}"
GATE_S = 10.0  # the longest a held-back write waits (a protocol the watch did not foresee)
SPLITS = (Split([0], [1, 2]), Split([0, 1, 2]))  # the telling one first: its first rank is global rank 1


def atomic_payload(group_index: int, rank_in_group: int, step: int, shape=(2, 3), dtype=torch.float64) -> torch.Tensor:
    """What rank ``rank_in_group`` of group ``group_index`` saves: other values on every rank."""
    g = torch.Generator().manual_seed(1000 * step + 10 * group_index + rank_in_group)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


class _Watch:
    """One rank's instruments around the learner's save: ``torch.save``, ``os.rename`` /
    ``os.replace`` and the collectives, with flag files (shared by the group's ranks) that order
    the writes: the group's other ranks write only once its first rank has written its own file
    and entered a collective, renamed or returned."""

    def __init__(self, flags: Path, final: Path, rank: int, size: int, group, payloads: list):
        self.flags, self.final, self.rank, self.size, self.group = flags, final, rank, size, group
        self.payloads, self.problems, self.saved = payloads, [], False

    def flag(self, name: str) -> None:
        (self.flags / name).touch()

    def has(self, name: str) -> bool:
        return (self.flags / name).exists()

    def save(self, original):
        def watched_save(obj, f, *args, **kwargs):
            path = Path(f) if isinstance(f, (str, os.PathLike)) else None
            if path is not None and path.resolve().parent == self.final.resolve():
                self.problems.append(
                    f"rank {self.rank} of the group wrote {path.name} straight into {self.final.name}: a save killed "
                    "half-way would leave a directory under the final name that looks like a whole checkpoint. "
                    "Write into a temporary directory and rename it once every rank is done"
                )
            if self.rank != 0 and not self.saved:  # held back: see the class's docstring
                deadline = time.monotonic() + GATE_S
                while not any(self.has(n) for n in ("first-collective", "first-rename", "first-returned")):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
            result = original(obj, f, *args, **kwargs)
            self.saved = True
            return result

        return watched_save

    def collective(self, name, original):
        import torch.distributed as dist

        want = dist.get_process_group_ranks(self.group)

        def watched_collective(*args, **kwargs):
            import inspect

            given = inspect.signature(original).bind(*args, **kwargs).arguments.get("group")
            ranks = dist.get_process_group_ranks(given or dist.group.WORLD)
            if ranks != want:
                over = (
                    "the default group, the world (no group=)"
                    if given in (None, dist.group.WORLD)
                    else f"the group of ranks {ranks}"
                )
                self.problems.append(
                    f"dist.{name} went over {over}, not over the group the save was given, "
                    f"ranks {want}: pass group=group to every collective"
                )
                raise RuntimeError(f"dist.{name} over another group than the one given (refused by the test)")
            if self.rank == 0 and self.saved:
                self.flag("first-collective")
            return original(*args, **kwargs)

        return watched_collective

    def rename(self, original):
        def watched_rename(src, dst, *args, **kwargs):
            if Path(dst).resolve() != self.final.resolve():
                return original(src, dst, *args, **kwargs)
            self.flag(f"rename-{self.rank}")
            if self.rank != 0:
                self.problems.append(
                    f"rank {self.rank} of the group renamed a directory to {self.final.name} too: the rename is the "
                    "commit, made once, by the group's first rank (dist.get_rank(group) == 0), after the barrier"
                )
                return None  # not made: the first rank's rename is the one checked
            missing = [r for r in range(self.size) if not self._holds(Path(src) / f"rank{r}.pt", r)]
            if missing:
                present = sorted(p.name for p in Path(src).iterdir()) if Path(src).is_dir() else []
                self.problems.append(
                    f"the group's first rank renamed {Path(src).name} to {self.final.name} while it held {present}, "
                    f"without the file(s) of rank(s) {missing} of the group: "
                    + (
                        "the files are named by the global rank; name them by the rank within the group, "
                        "dist.get_rank(group)"
                        if len(present) == self.size and missing
                        else "the rename must wait until every rank has written its file (a barrier over the group "
                        "between the writes and the rename)"
                    )
                )
            self.flag("first-rename")
            if missing:  # not made: the others may still write into the temporary directory, then go on
                return None
            return original(src, dst, *args, **kwargs)

        return watched_rename

    def _holds(self, path: Path, rank: int) -> bool:
        try:
            want = self.payloads[rank]
            return bool(torch.equal(torch.load(path, map_location=want.device, weights_only=True), want))
        except Exception:
            return False


def atomic_on_rank(ctx, save_atomically, split, root, flags, step, payload=None):
    import torch.distributed as dist

    index, group, ranks = split.group_of(ctx)
    rank, size = ranks.index(ctx.rank), len(ranks)
    groot, gflags = Path(root) / f"group{index}", Path(flags) / f"group{index}"
    final = groot / FINAL.format(step)
    payloads = [
        atomic_payload(index, r, step, **payload or {}).to(ctx.device)  # drawn on the host, moved
        for r in range(size)
    ]
    watch = _Watch(gflags, final, rank, size, group, payloads)
    tensor = payloads[rank]
    returned, error = None, None
    torch_save, serialization_save, rename, replace = torch.save, torch.serialization.save, os.rename, os.replace
    try:
        torch.save = torch.serialization.save = watch.save(serialization_save)
        os.rename, os.replace = watch.rename(rename), watch.rename(replace)
        with swapped_dist_functions(COLLECTIVES, watch.collective):
            returned = save_atomically(str(groot), step, tensor, group)
    except NotImplementedError:
        raise
    except Exception as err:  # reported with what the watch saw, which says more
        error = f"{type(err).__name__}: {err}"
    finally:
        torch.save, torch.serialization.save, os.rename, os.replace = torch_save, serialization_save, rename, replace
        if rank == 0:
            watch.flag("first-returned")
    dist.barrier()  # every rank's save is over before the driver reads the directory
    return dict(
        group=ranks,
        rank=rank,
        problems=watch.problems,
        error=error,
        returned=None if returned is None else str(returned),
    )


def _check_directory(
    groot: Path, step: int, index: int, ranks: list, flags: Path, payload=None, before: dict | None = None
) -> None:
    """The checkpoint the group left in ``groot``; ``before``: {name: (file name, bytes)} of what
    ``groot`` held before the save, to be there unchanged (earlier checkpoints)."""
    before = before or {}
    final = groot / FINAL.format(step)
    where = f"save_atomically(root, step={step}, tensor, group) on the group of ranks {ranks}"
    if not final.is_dir():
        first = (
            "the global rank 0, which is not in this group: the group's first rank is dist.get_rank(group) == 0"
            if ranks[0] != 0
            else "the group's first rank"
        )
        raise AssertionError(
            f"{where}: no {final.name} in root after every rank returned. Its first rank, global rank "
            f"{ranks[0]}, renames the temporary directory to it; a test of ctx.rank == 0 or "
            f"dist.get_rank() == 0 picks {first}"
        )
    if not (flags / "rename-0").exists():
        raise AssertionError(
            f"{where}: {final.name} appeared without a rename (copied, or made and filled): a crash "
            "half-way through a copy leaves a directory under the final name. Only a rename within "
            "one file system (os.replace) is atomic"
        )
    names = sorted(p.name for p in final.iterdir())
    want = [f"rank{r}.pt" for r in range(len(ranks))]
    if names != sorted(want):
        hint = (
            " The files are named by the global rank: name them by the rank within the group, dist.get_rank(group)"
            if names == sorted(f"rank{r}.pt" for r in ranks)
            else ""
        )
        raise AssertionError(f"{where}: {final.name} holds {names}; expected {want}.{hint}")
    for r in range(len(ranks)):
        got = torch.load(final / f"rank{r}.pt", map_location="cpu", weights_only=True)
        want = atomic_payload(index, r, step, **payload or {})
        assert torch.is_tensor(got) and got.dtype == want.dtype and torch.equal(got, want), (
            f"{where}: {final.name}/rank{r}.pt does not hold the tensor rank {r} of the group was given"
        )
    for name, (inner, content) in before.items():
        path = groot / name / inner
        assert path.is_file() and path.read_bytes() == content, (
            f"{where}: root held {name} before the save (an earlier checkpoint), and after it "
            + (f"{name}/{inner} is changed" if path.is_file() else f"{name}/{inner} is gone")
            + ": a save removes nothing but what it made itself (its temporary directory, by renaming it)"
        )
    extra = sorted(p.name for p in groot.iterdir() if p.name != final.name and p.name not in before)
    assert not extra, (
        f"{where}: {extra} left in root beside {final.name}: the temporary directory becomes the "
        "checkpoint by its rename, nothing of the save stays behind"
    )


@exercise("a4.atomic_save", points=2)
def test_atomic_save(save_atomically, quick: bool = True, timeout: float = 60):
    """Committed only once every rank of the group has written, by the group's first rank, under the final
    name, on a group that is not the world (ranks [1, 2] beside [0]) and on the whole world of 3."""
    savers = [store.save_checkpoint, store.save_checkpoint_async, store._commit]
    learner = without_library(
        save_atomically, savers, "a4.atomic_save", "write the files, the barrier and the rename yourself"
    )
    scratch = Path(tempfile.mkdtemp(prefix="a4-atomic-"))
    try:
        for step, split in zip((7, 12), SPLITS):
            root, flags = scratch / f"root{step}", scratch / f"flags{step}"
            for index in range(len(split.groups)):
                (root / f"group{index}").mkdir(parents=True)
                (flags / f"group{index}").mkdir(parents=True)
            per_rank = split.run(
                atomic_on_rank, learner, split, str(root), str(flags), step, what="a4.atomic_save", timeout=timeout
            )
            judge_atomic(per_rank, split, root, flags, step)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def judge_atomic(per_rank, split, root, flags, step, payload=None, before=None) -> None:
    for report in per_rank:  # what the watch saw first: it names the mistake
        if report["problems"]:
            raise AssertionError(f"save_atomically on the group of ranks {report['group']}: {report['problems'][0]}")
    for report in per_rank:
        if report["error"]:
            raise AssertionError(
                f"save_atomically on the group of ranks {report['group']}, its rank "
                f"{report['rank']}, raised {report['error']}"
            )
    for index, ranks in enumerate(split.groups):
        _check_directory(root / f"group{index}", step, index, list(ranks), flags / f"group{index}", payload, before)
    for report in per_rank:
        final = root / f"group{split.groups.index(tuple(report['group']))}" / FINAL.format(step)
        assert report["returned"] is not None and Path(report["returned"]).resolve() == final.resolve(), (
            f"save_atomically on the group of ranks {report['group']}, its rank {report['rank']}, returned "
            f"{report['returned']!r}; return the checkpoint's final directory, {final.name} in root, on every rank"
        )
