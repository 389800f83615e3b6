"""Run chapters headless with papermill, e.g. in a batch job on a GPU node.

    python launch/batch.py chapters                      # every chapter, defaults
    python launch/batch.py --world-size 8 --full chapters/02_data_parallelism.ipynb

Executed copies go to out/ (the originals are not touched); a table of status and
duration is printed and written to out/batch.json. Exit code 1 if any failed.
"""

import argparse
import json
import pathlib
import sys
import time

import papermill


def notebooks(paths):
    for p in map(pathlib.Path, paths):
        yield from sorted(p.glob("*.ipynb")) if p.is_dir() else [p]


def record(params, rows) -> pathlib.Path:
    """The run's table with its provenance, as a GPU record: which chapters ran on which GPU."""
    import torch
    from ultrascale import records

    if not torch.cuda.is_available():
        raise SystemExit("--record keeps GPU runs only (results/ holds what a CPU cannot measure); no CUDA GPU here")
    device = torch.cuda.get_device_name(0)
    return records.write("batch", dict(records.provenance(device), parameters=params, runs=rows,
                                       gpus=torch.cuda.device_count()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--world-size", type=int, default=None, help="WORLD_SIZE parameter")
    parser.add_argument("--full", action="store_true", help="QUICK=False: full sizes")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="out")
    parser.add_argument("--record", action="store_true",
                        help="on a CUDA GPU, also keep the table in results/batch_<device>.json (see results/README.md)")
    args = parser.parse_args(argv)
    params = {"QUICK": not args.full}
    if args.world_size is not None:
        params["WORLD_SIZE"] = args.world_size
    if args.seed is not None:
        params["SEED"] = args.seed
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nb in notebooks(args.paths):
        start = time.monotonic()
        try:
            papermill.execute_notebook(str(nb), str(out / nb.name), parameters=params,
                                       cwd=str(nb.parent), kernel_name="python3", progress_bar=False)
            status = "ok"
        except papermill.PapermillExecutionError as exc:
            status = f"failed: {exc.ename}: {exc.evalue}"[:200]
        rows.append({"notebook": str(nb), "status": status, "seconds": round(time.monotonic() - start, 1)})
        print(f"{nb.name:45s} {rows[-1]['seconds']:7.1f} s  {status}", flush=True)
    (out / "batch.json").write_text(json.dumps({"parameters": params, "runs": rows}, indent=1))
    if args.record:
        print(f"recorded in {record(params, rows)}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
