"""Issue 53, item 2, for the formula, count and schedule exercises
(``exercise_tests.properties_formulas``): the solutions still pass their checks with the property
cases added, and wrong answers that pass every fixed case (each written as a learner might, on an
assumption the fixed cases happen to satisfy) fail on a drawn input with a message that names the
mistake. All run off a rank: seconds in all.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_grader_holes import _fails, _load

from ultrascale_grading.exercise_tests import properties_formulas
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import PASS, check

# exercise id -> (solution notebook, the function names its check() takes, in order)
SOLVED = {
    "00.pipeline_stage_layers": ("00_orientation", ["pipeline_stage_layers"]),
    "00.memory_per_stage": ("00_orientation", ["memory_per_stage"]),
    "01.param_count": ("01_one_gpu", ["gpt_param_count"]),
    "01.activation_memory": ("01_one_gpu", ["activation_memory"]),
    "02.grad_acc_steps": ("02_data_parallelism", ["grad_acc_steps"]),
    "05.activation_memory": ("05_sequence_parallelism", ["activation_bytes_per_rank"]),
    "06.zigzag_chunks": ("06_context_parallelism", ["zigzag_positions", "tile_counts"]),
    "07.one_f_one_b": ("07_pipeline_parallelism", ["one_f_one_b_list"]),
    "07.bubble_fraction": ("07_pipeline_parallelism", ["bubble"]),
    "09.pp_activations": ("09_5d_parallelism", ["pp_activations"]),
    "09.rank_parameters": ("09_5d_parallelism", ["rank_parameters"]),
    "10.enumerate": ("10_best_configuration", ["layouts"]),
    "12.decode_float": ("12_mixed_precision", ["decode_float"]),
    "12.quantize_tiles": ("12_mixed_precision", ["quantize_tiles"]),
    "12.update_scale": ("12_mixed_precision", ["update_scale"]),
    "a2.scale_counts": ("a2_typical_scales", ["scale_counts"]),
    "a2.forward_flops": ("a2_typical_scales", ["forward_flops"]),
    "a2.llama_params": ("a2_typical_scales", ["llama_params"]),
    "a3.dp_ratio": ("a3_overlap_math", ["dp_ratio"]),
    "a3.hiding_limits": ("a3_overlap_math", ["max_tp", "min_layers_per_stage"]),
    "a3.bucketed_exposure": ("a3_overlap_math", ["exposed_allreduce_time"]),
}

_NOTEBOOKS: dict = {}


def solution(exercise_id: str, name: str | None = None):
    """The solution notebook's function for ``exercise_id`` (its first, or the one named)."""
    notebook, names = SOLVED[exercise_id]
    if notebook not in _NOTEBOOKS:
        _NOTEBOOKS[notebook] = _load(f"{notebook}_exercises.ipynb")
    return _NOTEBOOKS[notebook][name or names[0]]


def test_every_formula_exercise_has_a_property_in_the_merged_table():
    assert set(properties_formulas.PROPERTIES) == set(SOLVED)
    for exercise_id, prop in properties_formulas.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop
        assert prop.argument < len(SOLVED[exercise_id][1])


@pytest.mark.parametrize("exercise_id", sorted(SOLVED))
def test_the_solution_passes_its_fixed_cases_and_its_property(exercise_id):
    functions = [solution(exercise_id, name) for name in SOLVED[exercise_id][1]]
    result = check(exercise_id, *functions, quick=True)
    assert result.status == PASS, result


def test_the_forward_flops_reference_is_what_flop_counter_mode_counts():
    """The property's reference for a2.forward_flops is a formula from the library's counts: it must
    be the measured number, on models built from configs of the kinds the property draws."""
    from torch.utils.flop_counter import FlopCounterMode

    from ultrascale.model import GPTConfig, LlamaConfig, build_model

    configs = [
        GPTConfig(vocab_size=7, hidden=6, layers=1, heads=3),
        LlamaConfig(vocab_size=5, hidden=12, layers=2, heads=6, kv_heads=2, ffn=7, tie_embeddings=True),
        LlamaConfig(vocab_size=33, hidden=16, layers=1, heads=4, kv_heads=1, ffn=9, tie_embeddings=False),
    ]
    for config, batch, seq in zip(configs, (3, 1, 2), (5, 9, 1)):
        torch.manual_seed(0)
        model = build_model(config)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, config.vocab_size, (batch, seq)))
        assert properties_formulas.reference_forward_flops(config, batch, seq) == counter.get_total_flops(), config


# ---- wrong answers that pass every fixed case ---------------------------------------------------


def test_stage_layers_from_a_float_division_fail_past_two_to_the_53():
    def pipeline_stage_layers(num_layers, pp_degree):
        if not 1 <= pp_degree <= num_layers:
            raise ValueError("a stage needs a layer")
        base = int(num_layers / pp_degree)  # a float: exact for every layer count a model has
        extra = num_layers - base * pp_degree
        return [base + (1 if stage < extra else 0) for stage in range(pp_degree)]

    _fails(
        check("00.pipeline_stage_layers", pipeline_stage_layers),
        "pipeline_stage_layers(4611686018427387905, 3)",
        "not 4611686018427387905",
        "2**53",
    )


def test_a_parameter_count_through_a_float_power_fails_on_large_odd_sizes():
    def gpt_param_count(hidden, vocab, layers, tied=True):
        h, v, L = hidden, vocab, layers
        return int(h * v + L * (12 * h**2.0 + 13 * h) + 2 * h + (0 if tied else h * v))

    _fails(
        check("01.param_count", gpt_param_count),
        "gpt_param_count(1048575, 262141, 4095, tied=False)",
        "2**53",
        "h ** 2.0",
    )


def test_a_recompute_check_against_a_string_accepts_its_pieces():
    def activation_memory(layers, hidden, heads, seq, micro_batch, recompute="none"):
        if recompute not in ("noneselectivefull"):  # the commas forgotten: one string, not a tuple
            raise ValueError(f"unknown recompute mode {recompute!r}")
        per_layer = seq * micro_batch * hidden
        if recompute == "none":
            return layers * per_layer * (34 + 5 * heads * seq / hidden)
        if recompute == "selective":
            return layers * per_layer * 34
        return layers * per_layer * 2

    _fails(
        check("01.activation_memory", activation_memory),
        "recompute='sel'",
        "should raise ValueError",
        "not a substring",
    )


def test_zigzag_positions_that_check_cp_instead_of_two_cp_fail():
    def zigzag_positions(seq, rank, cp):
        size = seq // (2 * cp)
        if seq % cp or size == 0:  # cp divides it: but the layout cuts 2 cp chunks
            raise ValueError(f"{seq} tokens do not split over {cp} ranks")
        late = 2 * cp - 1 - rank
        return torch.cat([torch.arange(rank * size, (rank + 1) * size), torch.arange(late * size, (late + 1) * size)])

    result = check("06.zigzag_chunks", zigzag_positions, solution("06.zigzag_chunks", "tile_counts"))
    _fails(
        result,
        "zigzag_positions(12, 0, 4)",
        "should raise ValueError",
        "2 * 4 = 8 equal chunks",
        "cp = 4 divides 12 is not enough",
    )


def test_a_bubble_from_sums_of_ends_and_starts_fails_on_wall_clock_times():
    def bubble(spans):
        start = min(a for rank in spans for a, _ in rank)
        end = max(b for rank in spans for _, b in rank)
        compute = sum(b for rank in spans for _, b in rank) - sum(a for rank in spans for a, _ in rank)
        return (len(spans) * (end - start) - compute) / compute

    _fails(check("07.bubble_fraction", bubble), "starting at t = 1.7e+09 s", "time.time()", "cancels")


def test_layouts_with_tp_a_power_of_two_fail_on_a_node_of_six():
    from test_grader_holes_ch10 import _layouts_without

    layouts = _layouts_without("tp a power of two")
    _fails(check("10.enumerate", layouts), "gpus_per_node=6", "is missing", "not only a power of two")


def test_decoding_with_an_index_fails_on_a_0d_tensor():
    def decode_float(x):
        info = torch.finfo(x.dtype)
        mantissa_bits = round(-math.log2(info.eps))
        exponent_bits = info.bits - 1 - mantissa_bits
        as_int = {32: torch.int32, 16: torch.int16, 8: torch.uint8}[info.bits]
        raw = int(x.view(as_int)[0]) & ((1 << info.bits) - 1)  # the tests' tensors are 1-D
        return (
            raw >> (info.bits - 1),
            (raw >> mantissa_bits) & ((1 << exponent_bits) - 1),
            raw & ((1 << mantissa_bits) - 1),
        )

    _fails(check("12.decode_float", decode_float), "shape () (0-d)", "IndexError")


def test_tiles_without_an_amax_floor_fail_on_an_all_zero_tile():
    def quantize_tiles(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        rows, cols = x.shape
        if rows % tile_rows or cols % tile_cols:
            raise ValueError("the tiles do not divide the matrix")
        top = torch.finfo(dtype).max
        tiles = x.detach().float().reshape(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols)
        scales = tiles.abs().amax(dim=(1, 3)) / top  # random tiles are never all zeros... until one is
        q = (tiles / scales[:, None, :, None]).clamp(-top, top).to(dtype)
        return q.reshape(rows, cols), scales

    _fails(
        check("12.quantize_tiles", quantize_tiles),
        "tile (0, 0) all zeros",
        "finite and positive",
        "clamp each tile's amax away from 0",
    )


def test_a_loss_scaler_with_a_rounded_float32_maximum_fails_just_below_it():
    def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if found_inf:
            return scale * backoff_factor, 0
        growth_tracker += 1
        if growth_tracker == growth_interval:
            grown = scale * growth_factor
            return (grown if grown <= 3.4e38 else scale), 0  # float32's largest value, roughly
        return scale, growth_tracker

    _fails(check("12.update_scale", update_scale), "torch.finfo(torch.float32).max itself, not a rounded constant")


def test_scale_counts_through_a_float_power_fail_on_large_odd_sizes():
    def scale_counts(h, layers, vocab, seq, mbs, glu=True, tied=True):
        block = (16 if glu else 12) * h**2.0
        parameters = int(layers * block + vocab * h * (1 if tied else 2))
        return {
            "tokens": seq * mbs,
            "hidden states": seq * mbs * h,
            "parameters": parameters,
            "gradients": parameters,
            "optimizer states": 3 * parameters,
        }

    _fails(check("a2.scale_counts", scale_counts), "scale_counts(1048575, 4095", "['parameters']", "2**53")


def test_a_tp_search_over_a_fixed_range_fails_where_wider_tp_hides():
    def max_tp(h, peak_flops, peak_bw, bytes_per_element=1):
        best = 1
        for tp in range(2, 65):  # no node has more than 64 GPUs
            if bytes_per_element * (tp - 1) / (2 * h) * peak_flops / peak_bw <= 1:
                best = tp
        return best

    result = check("a3.hiding_limits", max_tp, solution("a3.hiding_limits", "min_layers_per_stage"))
    _fails(result, "max_tp(16384, 1000000000000.0, 450000000000.0", "expected 14746", "search no fixed range")
