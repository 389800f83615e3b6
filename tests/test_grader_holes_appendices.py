"""The appendix exercises (A1-A3) cannot be fooled: plausible wrong answers fail with a message
that says what to fix, and the solution notebooks' own answers pass."""

from __future__ import annotations

import math
import statistics

from test_grader_holes import _fails

from ultrascale_grading import PASS, check


# ---- a1.timed_median -------------------------------------------------------------------


def test_timed_median_refuses_the_classic_benchmark_mistakes(a1):
    def no_sync_after_fn(fn, warmup, repeats, synchronize, clock):
        for _ in range(warmup):
            fn()
        synchronize()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            times.append(clock() - start)  # the launch only
        return statistics.median(times)

    def no_sync_after_warmup(fn, warmup, repeats, synchronize, clock):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        return statistics.median(times)

    def mean(fn, warmup, repeats, synchronize, clock):
        for _ in range(warmup):
            fn()
        synchronize()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        return statistics.mean(times)

    def warmup_timed_too(fn, warmup, repeats, synchronize, clock):
        times = []
        for _ in range(warmup + repeats):
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        return statistics.median(times)

    def one_call_too_many(fn, warmup, repeats, synchronize, clock):
        for _ in range(warmup + 1):
            fn()
        synchronize()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        return statistics.median(times)

    _fails(check("a1.timed_median", no_sync_after_fn), "only the time of the launch", "synchronize() after fn()")
    _fails(check("a1.timed_median", no_sync_after_warmup), "warm-up calls' work", "Synchronize after the warm-up")
    _fails(check("a1.timed_median", mean), "That is the mean", "median")
    _fails(check("a1.timed_median", warmup_timed_too), "warm-up calls were timed")
    _fails(check("a1.timed_median", one_call_too_many), "fn was called more than warmup + repeats")
    assert check("a1.timed_median", a1["time_median"]).status == PASS


# ---- a1.launched_by --------------------------------------------------------------------


def test_launched_by_refuses_other_threads_outer_operators_copies_and_disorder(a1):
    solution = a1["launched_by"]

    def any_thread(events):
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("ph") == "X" and e.get("cat") != "kernel" and "correlation" in e.get("args", {})
        }
        out = []
        for k in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"]):
            launch = launches.get(k["args"].get("correlation"))
            around = [o for o in ops if launch and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]  # any thread
            out.append((k["name"], min(around, key=lambda o: o["dur"])["name"] if around else None))
        return out

    def outermost(events):
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("ph") == "X" and e.get("cat") != "kernel" and "correlation" in e.get("args", {})
        }
        out = []
        for k in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"]):
            launch = launches.get(k["args"].get("correlation"))
            around = [
                o
                for o in ops
                if launch
                and (o["pid"], o["tid"]) == (launch["pid"], launch["tid"])
                and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
            ]
            out.append((k["name"], max(around, key=lambda o: o["dur"])["name"] if around else None))
        return out

    def copies_too(events):
        right = solution(events)
        copies = [(e["name"], None) for e in events if e.get("cat") == "gpu_memcpy"]
        return right + copies

    def unsorted(events):
        return list(reversed(solution(events)))

    _fails(check("a1.launched_by", any_thread), "launch's own process and thread")
    _fails(check("a1.launched_by", outermost), "innermost (shortest)")
    _fails(check("a1.launched_by", copies_too), "memory copies are not kernels")
    _fails(check("a1.launched_by", unsorted), "wrong order", "start time ts")
    assert check("a1.launched_by", a1["launched_by"]).status == PASS


# ---- a1.communication_overlap ----------------------------------------------------------


def _spans(events):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events)


def test_communication_overlap_refuses_double_counting_and_containment(a1):
    def pairwise(compute, communication):  # nested operators and concurrent transfers count twice
        hidden = sum(
            max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in _spans(compute) for s2, e2 in _spans(communication)
        )
        return hidden, sum(e["dur"] for e in communication) - hidden

    def summed_communication(compute, communication):  # the hidden part right, the total not a union
        hidden, _ = a1["communication_overlap"](compute, communication)
        return hidden, sum(e["dur"] for e in communication) - hidden

    def contained_only(compute, communication):  # a transfer hides only inside one compute event
        total = a1["communication_overlap"]([], communication)[1]  # with no compute, all of it is exposed
        hidden = sum(
            c["dur"]
            for c in communication
            if any(o["ts"] <= c["ts"] and c["ts"] + c["dur"] <= o["ts"] + o["dur"] for o in compute)
        )
        return hidden, total - hidden

    def best_case(compute, communication):  # min(compute, communication): the prediction, not the trace
        busy = a1["communication_overlap"]([], compute)[1]
        talking = a1["communication_overlap"]([], communication)[1]
        return min(busy, talking), talking - min(busy, talking)

    def swapped(compute, communication):
        hidden, exposed = a1["communication_overlap"](compute, communication)
        return exposed, hidden

    def integer_microseconds(compute, communication):  # right on the random traces, not on real timestamps
        hidden, exposed = a1["communication_overlap"](compute, communication)
        return int(hidden), int(exposed)

    def library(compute, communication):
        from ultrascale.schedule.simulate import covered_seconds

        talking = covered_seconds(_spans(communication))
        hidden = covered_seconds(_spans(compute)) + talking - covered_seconds(_spans(compute) + _spans(communication))
        return hidden, talking - hidden

    exercise = "a1.communication_overlap"
    _fails(check(exercise, pairwise), "nested backward operators", "Merge each list into its union")
    _fails(check(exercise, summed_communication), "counts twice what two communication threads did")
    _fails(check(exercise, contained_only), "entirely inside one compute event", "partly hidden")
    _fails(check(exercise, best_case), "the most that could hide")
    _fails(check(exercise, swapped), "swapped")
    _fails(check(exercise, integer_microseconds), "real-trace timestamps")
    _fails(
        check(exercise, library), "your code called the course library's ultrascale.schedule.simulate.covered_seconds"
    )
    assert check(exercise, a1["communication_overlap"]).status == PASS


# ---- a2.scale_counts -------------------------------------------------------------------


def test_scale_counts_refuses_the_printed_optimizer_total_floats_and_the_library(a2):
    def counts(h, layers, vocab, seq, mbs, glu=True, tied=True, optimizer=3):
        params = layers * (16 if glu else 12) * h * h + vocab * h * (1 if tied else 2)
        return {
            "tokens": seq * mbs,
            "hidden states": seq * mbs * h,
            "parameters": params,
            "gradients": params,
            "optimizer states": optimizer * params,
        }

    def as_printed(h, layers, vocab, seq, mbs, glu=True, tied=True):
        return counts(h, layers, vocab, seq, mbs, glu, tied, optimizer=6)

    def without_master(h, layers, vocab, seq, mbs, glu=True, tied=True):
        return counts(h, layers, vocab, seq, mbs, glu, tied, optimizer=2)

    def floats(h, layers, vocab, seq, mbs, glu=True, tied=True):
        out = counts(h, layers, vocab, seq, mbs, glu, tied)
        return {**out, "parameters": float(layers * (16 if glu else 12) * h**2.0 + vocab * h * (1 if tied else 2))}

    def head_always(h, layers, vocab, seq, mbs, glu=True, tied=True):
        return counts(h, layers, vocab, seq, mbs, glu, False)

    def library(h, layers, vocab, seq, mbs, glu=True, tied=True):
        from ultrascale.scales import model_params

        return counts(h, layers, vocab, seq, mbs, glu, tied) | {"parameters": model_params(h, layers, vocab, glu, tied)}

    _fails(check("a2.scale_counts", as_printed), "the book's '6h²' as printed", "3 fp32 elements per parameter")
    _fails(check("a2.scale_counts", without_master), "fp32 master weights are missing")
    _fails(check("a2.scale_counts", floats), "count with integers")
    _fails(check("a2.scale_counts", head_always), "tied=True: the head reuses the embedding")
    _fails(check("a2.scale_counts", library), "your code called the course library's ultrascale.scales.model_params")
    assert check("a2.scale_counts", a2["scale_counts"]).status == PASS


# ---- a2.forward_flops ------------------------------------------------------------------


def test_forward_flops_refuses_6n_missing_attention_full_kv_and_measuring(a2):
    def two_t_n(config, batch, seq):
        from ultrascale.model import count_params

        return 2 * batch * seq * count_params(config)

    def weights_only(config, batch, seq):
        h = config.hidden
        kv = getattr(config, "kv_heads", config.heads) * config.head_dim
        mlp = 3 * h * config.ffn if type(config).__name__ == "LlamaConfig" else 8 * h * h
        return 2 * batch * seq * (config.layers * (2 * h * h + 2 * h * kv + mlp) + h * config.vocab_size)

    def full_kv(config, batch, seq):
        h = config.hidden
        mlp = 3 * h * config.ffn if type(config).__name__ == "LlamaConfig" else 8 * h * h
        weights = config.layers * (4 * h * h + mlp) + h * config.vocab_size
        return 2 * batch * seq * weights + batch * seq * 4 * seq * h * config.layers

    def measure(config, batch, seq):
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from ultrascale.model import build_model

        with FlopCounterMode(display=False) as counter:
            build_model(config)(torch.zeros(batch, seq, dtype=torch.long))
        return counter.get_total_flops()

    _fails(check("a2.forward_flops", two_t_n), "multiplied by every parameter", "table lookup")
    _fails(check("a2.forward_flops", weights_only), "attention's Q·K^T and scores·V", "are missing")
    _fails(check("a2.forward_flops", full_kv), "k and v are narrower than h x h")
    _fails(check("a2.forward_flops", measure), "used FlopCounterMode", "predict")
    assert check("a2.forward_flops", a2["forward_flops"]).status == PASS


# ---- a2.llama_params -------------------------------------------------------------------


def test_llama_params_refuses_missing_norms_full_kv_untied_heads_and_building(a2):
    def layer(c, kv):
        return 2 * c.hidden * c.hidden + 2 * c.hidden * kv + 3 * c.hidden * c.ffn

    def no_norms(c):
        return c.layers * layer(c, c.kv_heads * c.head_dim) + c.vocab_size * c.hidden * (1 if c.tie_embeddings else 2)

    def no_final_norm(c):
        return a2["llama_params"](c) - c.hidden

    def full_kv(c):  # k and v as wide as q
        return a2["llama_params"](c) + c.layers * 2 * c.hidden * (c.hidden - c.kv_heads * c.head_dim)

    def head_always(c):  # tie_embeddings ignored
        return a2["llama_params"](c) + (c.vocab_size * c.hidden if c.tie_embeddings else 0)

    def estimate(c):
        return a2["scale_counts"](c.hidden, c.layers, c.vocab_size, 1, 1, tied=c.tie_embeddings)["parameters"]

    def floats(c):
        return float(a2["llama_params"](c))

    def building(c):
        from ultrascale.model import build_model

        return sum(p.numel() for p in build_model(c).parameters())

    exercise = "a2.llama_params"
    _fails(check(exercise, no_norms), "8,030,261,248", "RMSNorm weights are parameters too")
    _fails(check(exercise, no_final_norm), "final RMSNorm")
    _fails(check(exercise, full_kv), "not h x h")
    _fails(check(exercise, head_always), "tie_embeddings=True", "v·h once")
    _fails(check(exercise, estimate), "A2's 16h² estimate")
    _fails(check(exercise, floats), "count with integers")
    _fails(check(exercise, building), "your code called the course library's ultrascale.model.build_model")
    assert check(exercise, a2["llama_params"]).status == PASS


# ---- a3.dp_ratio -----------------------------------------------------------------------


def test_dp_ratio_refuses_the_printed_form_and_wrong_factors(a3):
    def as_printed(num_tokens, num_params, dp, peak_flops, peak_bw):
        return num_params / (2 * num_tokens) * (dp - 1) / dp * peak_flops / peak_bw

    def forward_compute(num_tokens, num_params, dp, peak_flops, peak_bw):
        t_comm = num_params * 2 * (dp - 1) / (dp * peak_bw)
        return t_comm / (2 * num_tokens * num_params / peak_flops)  # the forward, not the backward

    def no_ring_factor(num_tokens, num_params, dp, peak_flops, peak_bw):
        return num_params * 2 / peak_bw / (4 * num_tokens * num_params / peak_flops)

    def library(num_tokens, num_params, dp, peak_flops, peak_bw):
        from ultrascale.overlap import dp_comm_time, dp_compute_time

        return dp_comm_time(num_params, dp, peak_bw) / dp_compute_time(num_tokens, num_params, peak_flops)

    _fails(check("a3.dp_ratio", as_printed), "the ratio as printed in the book", "num_params cancels")
    _fails(check("a3.dp_ratio", forward_compute), "It is 2 times the right value", "backward is 4TN")
    _fails(check("a3.dp_ratio", no_ring_factor), "(DP-1)/DP of the ring all-reduce is missing")
    _fails(check("a3.dp_ratio", library), "your code called the course library's ultrascale.overlap.dp_comm_time")
    assert check("a3.dp_ratio", a3["dp_ratio"]).status == PASS


# ---- a3.hiding_limits ------------------------------------------------------------------


def test_hiding_limits_refuse_strict_inequalities_and_fractions(a3):
    def max_tp_strict(h, peak_flops, peak_bw, bytes_per_element=1):
        tp = 1
        while bytes_per_element * tp / (2 * h) * peak_flops / peak_bw < 1:  # the ratio of tp + 1, with < for <=
            tp += 1
        return tp

    def max_tp_unrounded(h, peak_flops, peak_bw, bytes_per_element=1):
        return 1 + 2 * h * peak_bw / (bytes_per_element * peak_flops)

    def min_layers_floor(h, peak_flops, peak_bw, bytes_per_element=1):
        return max(1, math.floor(bytes_per_element * peak_flops / (32 * h * peak_bw)))  # rounds down

    right_tp, right_layers = a3["max_tp"], a3["min_layers_per_stage"]
    _fails(check("a3.hiding_limits", max_tp_strict, right_layers), "Off by one", "ratio exactly 1 still hides")
    _fails(check("a3.hiding_limits", max_tp_unrounded, right_layers), "return a whole number")
    _fails(check("a3.hiding_limits", right_tp, min_layers_floor), "Off by one", "round the needed number of layers up")
    assert check("a3.hiding_limits", right_tp, right_layers).status == PASS


# ---- a3.bucketed_exposure --------------------------------------------------------------


def test_bucketed_exposure_refuses_parallel_links_perfect_overlap_and_the_last_bucket_alone(a3):
    def comm_times(bucket_bytes, dp, peak_bw):
        return [n * 2 * (dp - 1) / (dp * peak_bw) for n in bucket_bytes]

    def parallel_links(backward_times, bucket_bytes, dp, peak_bw):  # no queue: every bucket starts when ready
        ready, end = 0.0, 0.0
        for compute, t in zip(backward_times, comm_times(bucket_bytes, dp, peak_bw)):
            ready += compute
            end = max(end, ready + t)
        return max(0.0, end - ready)

    def perfect_overlap(backward_times, bucket_bytes, dp, peak_bw):
        return max(0.0, sum(comm_times(bucket_bytes, dp, peak_bw)) - sum(backward_times))

    def last_bucket(backward_times, bucket_bytes, dp, peak_bw):
        return comm_times(bucket_bytes, dp, peak_bw)[-1]

    def no_ring_factor(backward_times, bucket_bytes, dp, peak_bw):
        return a3["exposed_allreduce_time"](backward_times, bucket_bytes, 2, peak_bw)  # dp 2: factor 1

    def nothing_hidden(backward_times, bucket_bytes, dp, peak_bw):
        return sum(comm_times(bucket_bytes, dp, peak_bw))

    def library(backward_times, bucket_bytes, dp, peak_bw):
        from ultrascale.overlap import dp_comm_time

        ready = free = 0.0
        for compute, nbytes in zip(backward_times, bucket_bytes):
            ready += compute
            free = max(ready, free) + dp_comm_time(nbytes, dp, peak_bw)
        return max(0.0, free - ready)

    exercise = "a3.bucketed_exposure"
    _fails(check(exercise, parallel_links), "backward_times=[1, 1, 1, 1], bucket_bytes=[2, 2, 2, 2]", "they share it")
    _fails(check(exercise, perfect_overlap), "assumes perfect overlap", "the last one always starts")
    _fails(check(exercise, last_bucket), "the last bucket's all-reduce alone")
    _fails(check(exercise, no_ring_factor), "2(dp-1)/dp of the ring all-reduce is missing")
    _fails(check(exercise, nothing_hidden), "as if none of it overlapped")
    _fails(check(exercise, library), "your code called the course library's ultrascale.overlap.dp_comm_time")
    assert check(exercise, a3["exposed_allreduce_time"]).status == PASS
