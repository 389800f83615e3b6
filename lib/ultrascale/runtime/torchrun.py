"""Run a notebook experiment function under ``torchrun`` (one node or many, SLURM too).

The function has the same signature as for ``Cluster.run``: ``fn(ctx, *args)``.

    torchrun --nproc_per_node=4 -m ultrascale.runtime.torchrun mymodule:experiment '[1024]'

(``launch/torchrun.sh`` and the SLURM templates in ``launch/`` wrap this line.)
torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; we join
the process group from them (``env://``), call the function, gather every rank's
result on rank 0 and print them as JSON (also written to ``--out`` if given).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist

from .context import RankContext, to_cpu


def load_function(spec: str):
    """``package.module:function`` or ``path/to/file.py:function``.

    Both are looked up from the current directory first (``python -m`` puts it on
    ``sys.path``): ``launch/torchrun.sh`` runs where it is called, so a learner's own
    module beside them is found.
    """
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise FileNotFoundError(f"{target}: no such file in {os.getcwd()}")
        spec_ = importlib.util.spec_from_file_location("_experiment", target)
        module = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if not (target == exc.name or target.startswith(f"{exc.name}.")):
                raise  # the module was found; something it imports was not
            raise ModuleNotFoundError(
                f"no module {target!r} in {os.getcwd()} nor on PYTHONPATH: run from "
                "the folder that holds it, or add that folder to PYTHONPATH",
                name=exc.name,
            ) from None
    return getattr(module, name)


def ranks_per_node() -> int:
    """How many ranks the launchers start on this node: one per GPU torch can see (SLURM
    shows a job only its GPUs), else one per CPU SLURM gave the job here, else 2."""
    gpus = torch.cuda.device_count()
    return gpus or int(os.environ.get("SLURM_CPUS_ON_NODE") or 2)


def rank_device(backend: str, local_rank: int, gpus: int | None = None) -> torch.device:
    """This rank's device: its own GPU under NCCL (one per rank), the CPU under gloo. More ranks
    on a node than GPUs is refused with what to do (CUDA would say "invalid device ordinal")."""
    if backend != "nccl":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if local_rank >= gpus:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: this node has {gpus} GPU(s) and torchrun started "
            f"at least {local_rank + 1} ranks on it, but NCCL needs one GPU per rank. Start "
            f"--nproc_per_node={gpus} per node (launch/torchrun.sh and the SLURM templates pick one per GPU), "
            "or pass --backend gloo to run the ranks on the CPU."
        )
    return torch.device("cuda", local_rank)


def backend_line(backend: str, world_size: int, nodes: int) -> str:
    """The line rank 0 prints first, so a job's log says whether the GPUs were used: a GPU
    cluster whose .venv got the CPU build of torch (setup run on a login node) would otherwise
    run every GPU job as gloo ranks on the CPU, with nothing in the log to say so."""
    where = f"{world_size} ranks on {nodes} node(s), backend {backend}"
    if backend == "nccl":
        return f"{where}, one GPU per rank ({torch.cuda.get_device_name(0)})"
    if torch.version.cuda is None:
        why = (
            f"torch {torch.__version__} is a CPU build (on a GPU cluster: .venv was set up where no "
            "GPU was seen; README, GPU-cluster quick start)"
        )
    elif not torch.cuda.is_available():
        why = "no GPU visible to torch here"
    else:
        why = "--backend gloo asked for"
    return f"{where}, on the CPU: {why}"


def run_under_torchrun(fn, *args, backend: str = "auto", **kwargs) -> list | None:
    """Join the torchrun process group, run ``fn(ctx, *args)``, gather results on rank 0."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    if rank == 0:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)  # torchrun's count of nodes
        print(f"ultrascale.runtime.torchrun: {backend_line(backend, world_size, nodes)}", flush=True)
    try:
        ctx = RankContext(rank=rank, world_size=world_size, backend=backend, device=device)
        result = to_cpu(fn(ctx, *args, **kwargs))
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (list, tuple)):
        return [_jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    return obj


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("function", help="MODULE:FUNCTION or FILE.py:FUNCTION taking (ctx, *args)")
    parser.add_argument("args", nargs="?", default="[]", help="JSON list of positional arguments")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--out", default=None, help="write the per-rank results to this JSON file")
    opts = parser.parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("not launched by torchrun: use `torchrun --nproc_per_node=N -m ultrascale.runtime.torchrun ...`")
    results = run_under_torchrun(load_function(opts.function), *json.loads(opts.args), backend=opts.backend)
    if results is not None:
        text = json.dumps({"results": _jsonable(results)})
        if opts.out:
            with open(opts.out, "w") as f:
                f.write(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
