"""A3's overlap ratios (ultrascale.overlap): each one is t_comm / t_compute of the book's two
lines, simplifies to the book's closed form (DP: to the derived form), and depends on what
the book says it depends on."""

import math

import numpy as np
import sympy as sp

from ultrascale import overlap
from ultrascale.comm import bus_factor
from ultrascale.scales import block_params

h, T, N, DP, TP, seq, mbs, F, B, L = sp.symbols("h T N DP TP seq mbs peak_flops peak_bw L", positive=True)


def same(a, b):
    return sp.simplify(a - b) == 0


def test_dp_ratio_is_derived_and_the_printed_one_is_num_params_times_larger():
    t_comm = overlap.dp_comm_time(N, DP, B)
    t_compute = overlap.dp_compute_time(T, N, F)
    assert same(t_comm, N * 2 * (DP - 1) / (DP * B)) and same(t_compute, 4 * T * N / F)
    derived = overlap.dp_ratio(T, N, DP, F, B)
    assert same(derived, t_comm / t_compute)
    assert same(derived, 1 / (2 * T) * (DP - 1) / DP * F / B)
    assert N not in derived.free_symbols
    assert same(overlap.dp_ratio_as_printed(T, N, DP, F, B) / derived, N)


def test_zero3_tp_pp_match_the_books_closed_forms():
    block = block_params(h)
    assert same(overlap.zero3_comm_time(block, DP, B), 16 * h**2 * (DP - 1) / (DP * B))
    assert same(overlap.zero3_compute_time(block, seq, mbs, F), 32 * seq * mbs * h**2 / F)
    assert same(overlap.zero3_ratio(seq, mbs, DP, F, B, block), 1 / (2 * seq * mbs) * (DP - 1) / DP * F / B)
    assert same(overlap.tp_ratio(h, TP, F, B, seq, mbs), (TP - 1) / (2 * h) * F / B)
    assert same(overlap.pp_compute_time(seq, mbs, h, L, F), 32 * seq * mbs * h**2 * L / F)
    assert same(overlap.pp_comm_time(seq, mbs, h, B), seq * mbs * h / B)
    assert same(overlap.pp_ratio(h, L, F, B, seq, mbs), F / (32 * h * L * B))
    for ratio in (overlap.tp_ratio(h, TP, F, B, seq, mbs), overlap.pp_ratio(h, L, F, B, seq, mbs)):
        assert sp.simplify(ratio).free_symbols.isdisjoint({seq, mbs})


def test_volumes():
    assert same(overlap.zero3_bytes_per_step(block_params(h), L, DP), 3 * L * 16 * h**2 / DP)
    assert same(overlap.tp_bytes_per_block(seq, mbs, h, TP) * L, 8 * L * seq * mbs * h / TP)
    assert overlap.pp_bytes_per_step(4, 2, 8, grad_acc=3) == 4 * 3 * 4 * 2 * 8


def test_bus_bandwidth_conventions_agree_with_comm():
    # the time formulas use nccl-tests' factors, as comm.bandwidth does
    assert math.isclose(overlap.dp_comm_time(1.0, 8, 1.0), bus_factor("all_reduce", 8))
    assert math.isclose(overlap.zero3_comm_time(1.0, 8, 1.0), bus_factor("all_gather", 8))


def test_numbers_arrays_and_the_four_ratios():
    r = overlap.overlap_ratios(
        h=4096, seq=4096, mbs=1, tp=8, dp=64, layers_per_stage=4, peak_flops=989e12, peak_bw=450e9
    )
    assert set(r) == {"DP", "ZeRO-3", "TP", "PP"}
    assert math.isclose(r["TP"], 7 / 8192 * 989e12 / 450e9)
    assert math.isclose(r["PP"], 989e12 / (32 * 4096 * 4 * 450e9))
    assert math.isclose(r["DP"], r["ZeRO-3"])  # same tokens: the whole gradient vs one block, same ratio
    hs = np.array([1024, 4096, 16384])
    assert np.all(np.diff(overlap.tp_ratio(hs, 8, 989e12, 450e9)) < 0)
    assert math.isclose(overlap.dp_ratio(64, 10**6, 2, 1e10, 1e9, bytes_per_element=4), 4 * 0.5 / 128 * 10)


def test_measure_matmul_flops_is_positive():
    assert overlap.measure_matmul_flops(64, repeats=3) > 0
