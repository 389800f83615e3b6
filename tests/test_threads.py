"""Importing ultrascale makes torch's idle OpenMP threads sleep instead of spinning
(``ultrascale._threads_wait_passively``), unless the user chose a policy; ranks inherit it."""

import os
import subprocess
import sys

SHOW = "import ultrascale, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy_after_import(env_value=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    return subprocess.run(
        [sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_import_sets_passive_waiting():
    assert _policy_after_import() == "PASSIVE"


def test_a_policy_the_user_chose_is_kept():
    assert _policy_after_import("ACTIVE") == "ACTIVE"


def test_ranks_inherit_the_policy():
    from ultrascale.runtime import Cluster

    with Cluster(2) as cluster:
        assert cluster.run(lambda ctx: os.environ.get("OMP_WAIT_POLICY")) == ["PASSIVE", "PASSIVE"]
