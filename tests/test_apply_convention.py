"""Every technique is applied by one function of one shape (CONTRIBUTING.md, "A technique"):
``apply_<technique>(model, mesh_or_group, *, plan=None, timeline=None, ...) -> nn.Module``,
returning the module this rank trains. Read from the signatures, so that a new technique that
returns something else, or names its arguments otherwise, fails here."""

import inspect
import typing

import pytest
import torch.nn as nn

from ultrascale.parallel import apply_cp, apply_data_parallel, apply_pp, apply_tp, apply_zero
from ultrascale.parallel.expert_parallel import apply_ep
from ultrascale.parallel.fsdp import apply_fsdp
from ultrascale.parallel.grad_sync import DATA_AXES
from ultrascale.precision import apply_fp8

DISTRIBUTED = [apply_tp, apply_cp, apply_ep, apply_pp, apply_zero, apply_fsdp, apply_data_parallel]


@pytest.mark.parametrize("apply", DISTRIBUTED + [apply_fp8], ids=lambda f: f.__name__)
def test_an_apply_returns_a_module(apply):
    returned = typing.get_type_hints(apply)["return"]
    assert isinstance(returned, type) and issubclass(returned, nn.Module), f"{apply.__name__} returns {returned}"


@pytest.mark.parametrize("apply", DISTRIBUTED, ids=lambda f: f.__name__)
def test_an_apply_takes_the_model_then_the_mesh_or_group_then_keywords(apply):
    parameters = inspect.signature(apply).parameters
    assert list(parameters)[:2] == ["model", "mesh_or_group"]
    assert parameters["mesh_or_group"].default is None  # None: every rank, as torch's groups
    for name in ("plan", "timeline"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, f"{apply.__name__}: {name}"


@pytest.mark.parametrize("apply", [apply_cp, apply_ep], ids=lambda f: f.__name__)
def test_a_technique_whose_ranks_see_other_data_can_leave_the_average_to_a_composition(apply):
    parameter = inspect.signature(apply).parameters["sync_gradients"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is True


def test_the_data_axes_are_where_the_composition_reads_them():
    from ultrascale.parallel import compose

    assert (compose.DENSE_AXES, compose.EXPERT_AXES) == (DATA_AXES["dense"], DATA_AXES["expert"])
    assert set(DATA_AXES["expert"]) == set(DATA_AXES["dense"]) - {"ep"}  # an expert lives on one ep rank


def test_importing_one_basic_form_alone_finds_every_refinement_registered():
    # A refinement registers itself with the basic form when the package imports it (the basic
    # module cannot import it: that would be an import circle). Python runs the package's
    # __init__ before any of its modules, so a fresh interpreter that imports only the basic
    # modules must find every table full.
    import subprocess
    import sys

    probe = (
        "from ultrascale.parallel.tensor_parallel import FORMS, VOCABULARY\n"
        "from ultrascale.parallel.context_parallel import CORES\n"
        "from ultrascale.parallel.ring_attention import KV_EXCHANGES\n"
        "from ultrascale.parallel.zero import REFINEMENTS\n"
        "print(sorted(FORMS), sorted(VOCABULARY), sorted(CORES), sorted(KV_EXCHANGES), sorted(REFINEMENTS))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == (
        "['async_tp', 'plain', 'sequence_parallel'] ['embedding', 'head'] ['ulysses'] "
        "['all_gather', 'ring'] ['stage 3']"
    ), out
