"""The cluster launchers as shipped (issue 19): launch/torchrun.sh on two "nodes" of this
machine, and launch/slurm.sbatch and launch/slurm_batch.sbatch on a real one-node SLURM.

The SLURM tests bring up munged, slurmctld and slurmd from Debian's packages (installed here
with apt-get if missing: 15 to 30 s) in a temporary folder (tests/slurm/local_slurm.py), submit
the templates unedited from a folder outside the repository, and stop every daemon by its PID
at the end. They skip, saying why, where that is impossible (not root, no apt-get, no network).
"""

import json
import os
import re
import signal
import shutil
import subprocess
from pathlib import Path

import pytest

from ultrascale.parity import tolerance
from ultrascale.runtime.examples import one_process_reference

from slurm.local_slurm import LocalSlurm, Unavailable, free_port, install_slurm

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"

# What a learner writes beside their notebook: a function for cluster.run, in their folder.
USER_MODULE = """
import os
import torch
import torch.distributed as dist


def where(ctx):
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    return {"rank": ctx.rank, "node": int(os.environ["GROUP_RANK"]), "sum": total.item()}
"""

# Variables a user's shell may carry that would change what the launchers pick by themselves.
LAUNCH_KNOBS = (
    "NPROC",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ULTRASCALE_ROOT",
    "PY",
    "WORLD_SIZE",
    "FULL",
    "OUT",
)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KNOBS and not k.startswith("SLURM_")}
    return {**env, **extra}


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "myexp.py").write_text(USER_MODULE)
    return tmp_path


def results(text: str) -> list:
    """The JSON line rank 0 prints: every rank's result."""
    lines = [line for line in text.splitlines() if line.startswith('{"results"')]
    assert len(lines) == 1, f"expected one results line in:\n{text}"
    return json.loads(lines[0])["results"]


def torchrun_sh_together(runs, cwd: Path, timeout: float = 240) -> list[str]:
    """Start ``launch/torchrun.sh ARGS`` once per (ARGS, env) at the same time; their outputs.
    Each runs in a session of its own, so a hung one is killed with its ranks (by group id)."""
    procs = [
        subprocess.Popen(
            [str(LAUNCH / "torchrun.sh"), *args],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for args, env in runs
    ]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * len(procs), "\n".join(outputs)
    return outputs


# ---------------------------------------------------------------- torchrun.sh, no SLURM
@pytest.mark.timeout(300)
def test_torchrun_sh_two_nodes_on_localhost_run_the_callers_module(user_dir):
    """The two lines a user types on two nodes, here side by side; run from the user's folder,
    so ``myexp`` (a module) and ``myexp.py`` (a file) are theirs, not the repository's."""
    env = clean_env(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    node1, node0 = torchrun_sh_together(
        [(["myexp.py:where"], {**env, "NODE_RANK": "1"}), (["myexp:where"], {**env, "NODE_RANK": "0"})], cwd=user_dir
    )
    assert "torchrun.sh: node 1 of 2, 1 ranks here, rendezvous 127.0.0.1:" in node1
    assert results(node0) == [{"rank": 0, "node": 0, "sum": 3.0}, {"rank": 1, "node": 1, "sum": 3.0}]
    # rank 0's log names the backend: how a learner checks that a GPU job used NCCL (README)
    assert re.search(
        r"^ultrascale\.runtime\.torchrun: 2 ranks on 2 node\(s\), backend (gloo|nccl), ", node0, re.MULTILINE
    ), node0


def test_torchrun_sh_several_nodes_need_a_port_they_share(user_dir):
    done = subprocess.run(
        [str(LAUNCH / "torchrun.sh"), "myexp:where"],
        cwd=user_dir,
        capture_output=True,
        text=True,
        env=clean_env(NNODES="2", NPROC="1"),
        timeout=60,
    )
    assert done.returncode == 2
    assert "set MASTER_ADDR and MASTER_PORT, the same on every node" in done.stderr


@pytest.mark.timeout(300)
def test_torchrun_sh_one_node_picks_a_free_port_so_two_runs_can_share_a_machine(user_dir):
    """Two runs at once on one machine: with one fixed port the second could not bind it."""
    outputs = torchrun_sh_together([(["myexp:where"], clean_env(NPROC="2"))] * 2, cwd=user_dir)
    ports = set()
    for text in outputs:
        assert results(text) == [{"rank": r, "node": 0, "sum": 3.0} for r in range(2)]
        launched = next(line for line in text.splitlines() if line.startswith("torchrun.sh:"))
        ports.add(launched.split("rendezvous 127.0.0.1:")[1].split(",")[0])
    assert len(ports) == 2, f"both runs used port {ports}"


# ---------------------------------------------------------------- a real SLURM
@pytest.fixture(scope="module")
def slurm():
    try:
        print(install_slurm())
    except Unavailable as exc:
        pytest.skip(f"no SLURM here: {exc}")
    cluster = LocalSlurm()
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    leftovers = cluster.stop()
    assert not leftovers, f"processes outlived the SLURM daemons (killed now): {leftovers}"


def submit(slurm, script: str, *args, cwd: Path, job_name: str):
    """sbatch from ``cwd``; the job's log, which the template names JOB_NAME-JOBID.log there."""
    job, rc = slurm.sbatch(["--time=10", script, *args], cwd=cwd, env=clean_env())
    log = cwd / f"{job_name}-{job}.log"
    assert log.exists(), f"no log {log.name} in the submit folder\n{slurm.logs()}"
    text = log.read_text()
    assert rc == 0, f"job {job} exited with {rc}:\n{text}\n{slurm.logs()}"
    return job, text


@pytest.mark.timeout(600)
def test_slurm_sbatch_from_outside_the_repository_trains_data_parallel_like_one_process(slurm, tmp_path):
    """Submitted by absolute path from a folder that is not the repository, no variable set:
    the template finds the repository, starts one rank per CPU the node gave it, and our DP
    over those ranks ends with the weights of one process trained on the whole batch."""
    job, log = submit(
        slurm,
        str(LAUNCH / "slurm.sbatch"),
        "ultrascale.runtime.examples:data_parallel_demo",
        "[3]",
        "--out",
        "dp.json",
        cwd=tmp_path,
        job_name="ultrascale",
    )
    port = 10000 + int(job) % 20000
    assert f"repository {ROOT}, in {tmp_path}, rendezvous {slurm.node}:{port}" in log
    ranks = results(log)
    assert ranks == json.loads((tmp_path / "dp.json").read_text())["results"]
    assert [r["world_size"] for r in ranks] == [slurm.cpus] * slurm.cpus  # ranks = CPUs given
    atol = tolerance("sgd")["atol"]
    assert all(r["max_difference"] <= atol for r in ranks), ranks
    # The weights summed: the same on every rank, and what this process gets on its own.
    reference = one_process_reference(slurm.cpus, steps=3)
    expected = sum(w.double().sum().item() for w in reference.values())
    count = sum(w.numel() for w in reference.values())
    assert len({r["weight_sum"] for r in ranks}) == 1, ranks
    assert abs(ranks[0]["weight_sum"] - expected) <= atol * count


@pytest.mark.timeout(600)
def test_slurm_batch_sbatch_runs_a_chapter_and_writes_the_table_where_the_log_says(slurm, tmp_path):
    """Submitted by a relative path from another folder, with a chapter by name."""
    script = os.path.relpath(LAUNCH / "slurm_batch.sbatch", tmp_path)
    job, log = submit(slurm, script, "00_orientation", cwd=tmp_path, job_name="ultrascale-batch")
    out = tmp_path / f"ultrascale-batch-{job}"
    assert f"WORLD_SIZE={slurm.cpus} QUICK=True; executed notebooks and batch.json go to {out}" in log
    table = json.loads((out / "batch.json").read_text())
    assert table["parameters"] == {"QUICK": True, "WORLD_SIZE": slurm.cpus}
    assert [(Path(r["notebook"]).name, r["status"]) for r in table["runs"]] == [("00_orientation.ipynb", "ok")]
    executed = json.loads((out / "00_orientation.ipynb").read_text())
    parameters = [c for c in executed["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert parameters and f"WORLD_SIZE = {slurm.cpus}" in "".join(parameters[0]["source"])
    assert all(c["execution_count"] for c in executed["cells"] if c["cell_type"] == "code")
    assert re.search(r"^00_orientation\.ipynb +[0-9.]+ s  ok$", log, re.M), log  # the table line


# ---------------------------------------------------------------- setup.sh's GPU warnings
# Issue 54: setup run on a cluster's login node installs the CPU build of torch (no GPU there),
# and GPU jobs then run as gloo ranks on the CPU without a word. `launch/setup.sh --check-gpu`
# runs the check setup ends with; here against fake tools: nvidia-smi, sinfo and the venv's
# python are scripts, and PATH holds nothing else, so the machine's own tools never answer.
# the second GPU's line a moment after the first, as a real nvidia-smi may write it: a reader that
# stops at the first line (grep -q) then kills it with SIGPIPE, which pipefail turns into "no GPU"
NVIDIA_SMI = {
    True: 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; sleep 0.2; '
    'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"',
    False: 'echo "No devices were found"; exit 6',
}  # as nvidia-smi says on a node without GPUs
CPU_TORCH, CUDA_TORCH, CUDA_TORCH_OLD_DRIVER = "2.13.0+cpu cpu 0", "2.13.0+cu128 12.8 1", "2.13.0+cu128 12.8 0"


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def setup_gpu_check(tmp_path: Path, gpus: bool, torch_says: str | None = None, sinfo: str | None = None, **env) -> str:
    """What `launch/setup.sh --check-gpu` prints: nvidia-smi listing two GPUs or none, the venv's
    torch as ``torch_says`` ("version cuda usable", the one line setup asks it for; None: the
    real .venv), SLURM's sinfo printing ``sinfo`` (None: no sinfo)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("dirname", "grep", "timeout", "sleep"):
        (tools / tool).symlink_to(shutil.which(tool))
    _script(tools / "nvidia-smi", NVIDIA_SMI[gpus])
    if sinfo is not None:
        _script(tools / "sinfo", f'echo "{sinfo}"')
    venv = ROOT / ".venv"
    if torch_says is not None:
        venv = tmp_path / "venv"
        (venv / "bin").mkdir(parents=True)
        _script(venv / "bin" / "python", f'echo "{torch_says}"')
    done = subprocess.run(
        [shutil.which("bash"), str(LAUNCH / "setup.sh"), "--check-gpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(tools), "VENV": str(venv), **env},
    )
    assert done.returncode == 0 and done.stdout == "", done
    return done.stderr


@pytest.mark.parametrize(
    "gpus, torch_says, sinfo, env, warning",
    [
        # a GPU node whose .venv was set up on a login node
        (True, CPU_TORCH, None, {}, "lists 2 GPU\\(s\\), but .* has torch 2.13.0\\+cpu, a CPU build"),
        (
            True,
            CUDA_TORCH_OLD_DRIVER,
            None,
            {},
            "torch 2.13.0\\+cu128 \\(CUDA 12.8\\) cannot use it: the NVIDIA driver",
        ),
        # no GPU where GPUs are expected, and the CPU build installed
        (False, CPU_TORCH, None, {"SLURM_JOB_ID": "4242"}, "no GPU is visible .* this is SLURM job 4242"),
        (
            False,
            CPU_TORCH,
            None,
            {"CUDA_VISIBLE_DEVICES": "0,1"},
            "no GPU is visible .* CUDA_VISIBLE_DEVICES=0,1 is set",
        ),
        (False, CPU_TORCH, "gpu:8(S:0-1)", {}, "no GPU is visible .* SLURM's nodes have GPUs .* a login node"),
        # nothing to say
        (True, CUDA_TORCH, None, {"SLURM_JOB_ID": "4242"}, None),  # a GPU node, set up there
        (False, CPU_TORCH, None, {}, None),  # a laptop
        (False, CPU_TORCH, "(null)", {}, None),  # a SLURM cluster without GPUs
        (False, CUDA_TORCH, None, {"SLURM_JOB_ID": "4242"}, None),  # a CUDA build: it would use a GPU node's
    ],
    ids=[
        "gpu-cpu-torch",
        "gpu-old-driver",
        "slurm-job-no-gpu",
        "cuda-visible-no-gpu",
        "login-node",
        "gpu-node-ok",
        "laptop",
        "cpu-cluster",
        "login-node-cuda-torch",
    ],
)
def test_setup_warns_when_gpus_and_torch_do_not_match(tmp_path, gpus, torch_says, sinfo, env, warning):
    said = setup_gpu_check(tmp_path, gpus, torch_says, sinfo, **env)
    if warning is None:
        assert said == "", said
    else:
        assert said.startswith("[setup] WARNING: ") and said.count("\n") == 1, said
        assert re.search(warning, said), said
        assert "rm -rf" in said or "driver" in said, f"the warning says no way out: {said}"


def test_setup_gpu_check_reads_the_real_venvs_torch(tmp_path):
    """The same check with .venv's own python: the line it asks torch for is read right."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this .venv has a CUDA build of torch: the check has nothing to say on a GPU")
    said = setup_gpu_check(tmp_path, gpus=True)
    assert f"has torch {torch.__version__}, a CPU build" in said, said
