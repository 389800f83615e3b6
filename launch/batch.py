"""Run chapters headless with papermill, e.g. in a batch job on a GPU node.

    python launch/batch.py chapters                      # every chapter, defaults
    python launch/batch.py --world-size 8 --full chapters/02_data_parallelism.ipynb
    python launch/batch.py 06 12 a1                      # chapters by name or number

A chapter is named as in chapters/: 06_context_parallelism, with or without .ipynb, or
just its number (06, a1). Paths (a notebook, a folder of them) work too.

Executed copies go to out/ (the originals are not touched); a table of status and
duration is printed and written to out/batch.json. Exit code 1 if any failed.
"""

import argparse
import json
import pathlib
import sys
import time

import papermill
from nbclient.exceptions import DeadKernelError
from ultrascale.headless import kernel_options


CHAPTERS = pathlib.Path(__file__).resolve().parent.parent / "chapters"


class UnknownChapter(ValueError):
    pass


def chapter(name: str) -> pathlib.Path:
    """chapters/NAME.ipynb for a chapter's name (06_context_parallelism, with or without
    .ipynb) or number (06, a1)."""
    stem = name.removesuffix(".ipynb")
    for nb in sorted(CHAPTERS.glob("*.ipynb")):
        if stem in (nb.stem, nb.stem.partition("_")[0]):
            return nb
    listing = ", ".join(nb.stem for nb in sorted(CHAPTERS.glob("*.ipynb")))
    raise UnknownChapter(f"no notebook or chapter named {name!r}; the chapters are: {listing}")


def notebooks(paths) -> list[pathlib.Path]:
    """The notebooks that paths name: a path (a notebook or a folder of them) if it exists,
    else a chapter's name or number. Raises UnknownChapter for anything else."""
    found = []
    for name in paths:
        p = pathlib.Path(name)
        if p.is_dir():
            inside = sorted(p.glob("*.ipynb"))
            if not inside:
                raise UnknownChapter(f"no notebooks in the folder {name}")
            found += inside
        else:
            found.append(p if p.is_file() else chapter(name))
    return found


def cpu_times(path: str, params, rows) -> pathlib.Path:
    """The run's table with its provenance, for the times the chapters state ("about 20 s on 2 CPU
    cores"): measured on a CPU, every chapter passing, in QUICK."""
    import os

    import torch
    from ultrascale import records

    if torch.cuda.is_available() or not params.get("QUICK") or any(r["status"] != "ok" for r in rows):
        raise SystemExit("--cpu-times keeps QUICK runs on a CPU where every chapter passed")
    device = f"cpu, {os.cpu_count()} cores"
    out = pathlib.Path(path)
    runs = [dict(r, notebook=pathlib.Path(r["notebook"]).name) for r in rows]  # the same on every machine
    out.write_text(json.dumps(dict(records.provenance(device), parameters=params, runs=runs), indent=1) + "\n")
    return out


def record(params, rows) -> pathlib.Path:
    """The run's table with its provenance, as a GPU record: which chapters ran on which GPU."""
    import torch
    from ultrascale import records

    if not torch.cuda.is_available():
        raise SystemExit("--record keeps GPU runs only (results/ holds what a CPU cannot measure); no CUDA GPU here")
    device = torch.cuda.get_device_name(0)
    return records.write(
        "batch", dict(records.provenance(device), parameters=params, runs=rows, gpus=torch.cuda.device_count())
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="CHAPTER_OR_PATH")
    parser.add_argument("--world-size", type=int, default=None, help="WORLD_SIZE parameter")
    parser.add_argument("--full", action="store_true", help="QUICK=False: full sizes")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="out")
    parser.add_argument(
        "--record",
        action="store_true",
        help="on a CUDA GPU, also keep the table in results/batch_<device>.json (see results/README.md)",
    )
    parser.add_argument(
        "--cpu-times",
        metavar="JSON",
        help="on a CPU, keep the times with their provenance in JSON (chapters/run_times.json: the "
        "run times the chapters state, tests/test_batch.py holds them to it)",
    )
    args = parser.parse_args(argv)
    try:
        chosen = notebooks(args.paths)
    except UnknownChapter as exc:
        parser.error(str(exc))  # exit code 2, with the usage line
    params = {"QUICK": not args.full}
    if args.world_size is not None:
        params["WORLD_SIZE"] = args.world_size
    if args.seed is not None:
        params["SEED"] = args.seed
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nb in chosen:
        start = time.monotonic()
        try:
            papermill.execute_notebook(
                str(nb),
                str(out / nb.name),
                parameters=params,
                cwd=str(nb.parent),
                kernel_name="python3",
                progress_bar=False,
                **kernel_options(),
            )
            status = "ok"
        except papermill.PapermillExecutionError as exc:
            status = f"failed: {exc.ename}: {exc.evalue}"[:200]
        except DeadKernelError as exc:  # the next chapter still runs, in a kernel of its own
            status = f"failed: the kernel died: {exc}"[:200]
        rows.append({"notebook": str(nb), "status": status, "seconds": round(time.monotonic() - start, 1)})
        print(f"{nb.name:45s} {rows[-1]['seconds']:7.1f} s  {status}", flush=True)
    (out / "batch.json").write_text(json.dumps({"parameters": params, "runs": rows}, indent=1))
    if args.record:
        print(f"recorded in {record(params, rows)}")
    if args.cpu_times:
        print(f"times kept in {cpu_times(args.cpu_times, params, rows)}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
