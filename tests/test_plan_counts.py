"""The planner's counts (chapter 10's calibration): the FLOPs and bytes its step-time model
charges, against what a real step of the course's techniques does. Counts depend on shapes,
not on the machine's load, so these checks are exact or tight and never timing-dependent."""

import pytest

from ultrascale.model import count_params
from ultrascale.plan import ParallelConfig, micro_batch_flops, step_time
from ultrascale.plan import calibrate as cal
from ultrascale.runtime import Cluster

MODEL = cal.CALIBRATION_MODEL


def test_counting_hardware_turns_parts_into_flops_and_bytes():
    hw = cal.counting_hardware(4)
    one = step_time(MODEL, ParallelConfig(mbs=2), MODEL.seq_len, hw)
    assert one["compute"] == pytest.approx(micro_batch_flops(MODEL, 2, MODEL.seq_len))
    dp = step_time(MODEL, ParallelConfig(dp=4, mbs=2), MODEL.seq_len, hw)
    # a ring all-reduce sends 2 (n-1)/n of the fp32 gradients
    assert dp["DP"] == pytest.approx(2 * 3 / 4 * 4 * count_params(MODEL))


@pytest.fixture(scope="module")
def counted():
    cluster = Cluster(2, backend="gloo")
    try:
        configs = cal.calibration_configs(2)
        yield configs, cal.compare_counts(cluster.run(cal.count_steps, configs), configs)
    finally:
        cluster.close()


def test_real_steps_cost_what_the_model_charges(counted):
    configs, counts = counted
    assert set(counts) == set(configs)
    # DP's all-reduce and PP's sends are exactly the model's bytes
    assert counts["DP"]["bytes_ratio"] == pytest.approx(1.0)
    assert counts["PP"]["bytes_ratio"] == pytest.approx(1.0)
    for name, c in counts.items():  # the chapter's bands: a model wrong by 2x fails them
        assert 1 / 1.25 <= c["flops_ratio"] <= 1.25, (name, c)
        assert 1 / 1.5 <= c["bytes_ratio"] <= 1.5, (name, c)


def test_a_model_wrong_by_two_fails_the_band(counted):
    _, counts = counted
    assert not 1 / 1.5 <= 2 * counts["DP"]["bytes_ratio"] <= 1.5
    assert not 1 / 1.25 <= 0.5 * counts["DP"]["flops_ratio"] <= 1.25
