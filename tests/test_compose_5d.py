"""5D compositions that real training runs use (issue 40), each against one process in float64
with the tolerances of ``tests/test_compose.py`` (``parity.TOLERANCES``), on 4 CPU ranks:

* TP with sequence parallelism inside pipeline stages: the stages exchange the sequence slice;
"""
import pytest

from ultrascale.parallel.compose import ParallelConfig
from ultrascale.parity.composition import assert_composition_matches, train_one_process
from ultrascale.runtime import shared_cluster

from test_compose import DATA, STEPS, composed, fresh_model

DENSE = [
    ParallelConfig(pp=2, tp=2, sp=True, microbatches=2),
]


@pytest.mark.parametrize("config", DENSE, ids=str)
def test_composition_trains_as_one_process(config):
    per_rank = shared_cluster(4).run(composed, config)
    assert_composition_matches(per_rank, train_one_process(fresh_model(), config, DATA, STEPS), config)
