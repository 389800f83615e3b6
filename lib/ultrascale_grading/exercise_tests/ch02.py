"""Tests of the chapter 2 exercises (solutions/02_data_parallelism_exercises.ipynb) that need
no cluster; the ones that train on clusters (``02.overlapped_dp_hooks``, ``02.bucket_manager``)
are tested in ``ch02_gradient_sync.py``.

* ``02.grad_acc_steps``: the batch-size recipe, gbs = mbs x grad_acc x dp, from tokens.
* ``02.assign_buckets``: group parameters, in reverse order, into buckets closed once they reach a byte cap.
"""

from __future__ import annotations

import torch

from ultrascale.batch_size import nearest_power_of_two, samples_per_step
from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, without_library
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel import build_buckets

CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)  # the model of every chapter 2 test


# ---- 02.grad_acc_steps ---------------------------------------------------------------


def reference_grad_acc_steps(gbs_tokens, seq_len, mbs, dp) -> int:
    gbs = samples_per_step(gbs_tokens, seq_len)  # rounded to the nearest power of two
    if mbs * dp > gbs:
        raise ValueError("GPU-rich")
    if gbs % (mbs * dp):
        raise ValueError("not divisible")
    return gbs // (mbs * dp)


def _recipe_cases(quick: bool):
    yield 4e6, 4096, 2, 128  # the book's example: grad_acc 4
    yield 4e6, 4096, 2, 512  # and with more GPUs: grad_acc 1
    yield 4e6, 4096, 2, 1024  # GPU-rich
    yield 4 * 2**20, 4096, 2, 128
    yield 1.5e6, 2048, 4, 8  # 732 samples -> 512 (nearest power of two on a log scale)
    yield 3e6, 2048, 1, 96  # 1464.8 -> 1024, and 96 does not divide it
    tokens = (5e5, 1e6, 2e6, 4e6, 8e6, 16e6) if quick else (5e5, 1e6, 1.5e6, 2e6, 3e6, 4e6, 6e6, 8e6, 16e6, 60e6)
    for gbs_tokens in tokens:
        for seq_len in (1024, 4096, 8192):
            for mbs in (1, 2, 4, 3):
                for dp in (1, 8, 64, 256, 512, 48):
                    yield gbs_tokens, seq_len, mbs, dp


@exercise("02.grad_acc_steps", points=1)
def test_grad_acc_steps(grad_acc_steps, quick: bool = True):
    grad_acc_steps = without_library(
        grad_acc_steps,
        [samples_per_step, nearest_power_of_two],
        "02.grad_acc_steps",
        "round gbs_tokens / seq_len to the nearest power of two with math.log2 and round",
    )
    for gbs_tokens, seq_len, mbs, dp in _recipe_cases(quick):
        call = f"grad_acc_steps({gbs_tokens:g}, {seq_len}, mbs={mbs}, dp={dp})"
        try:
            expected = reference_grad_acc_steps(gbs_tokens, seq_len, mbs, dp)
        except ValueError:
            expected = None
        samples = gbs_tokens / seq_len
        gbs = samples_per_step(gbs_tokens, seq_len)
        why = (
            "mbs x dp exceeds the global batch (GPU-rich)"
            if mbs * dp > gbs
            else f"mbs x dp = {mbs * dp} does not divide the global batch of {gbs} samples"
        )
        try:
            got = call_learner(
                grad_acc_steps,
                gbs_tokens,
                seq_len,
                mbs,
                dp,
                call=call,
                passthrough=(ValueError,),
                expected=f"a ValueError ({why})" if expected is None else f"grad_acc = {expected}",
            )
        except ValueError:
            got = None
        if expected is None:
            assert got is None, f"{call} returned {got!r}; it should raise ValueError: {why}"
            continue
        assert got is not None, f"{call} raised ValueError, but {gbs} samples = {mbs} x {expected} x {dp} works"
        assert isinstance(got, int) and not isinstance(got, bool), (
            f"{call} returned {got!r} ({type(got).__name__}); return a whole number of micro-batches (int)"
        )
        if got != expected:
            hint = ""
            if got == int(samples) // (mbs * dp) or got == round(samples / (mbs * dp)):
                hint = f" ({gbs_tokens:g} / {seq_len} = {samples:.1f} samples: round that to the nearest power of two first)"
            raise AssertionError(f"{call}: expected grad_acc = {expected} (gbs = {gbs} samples), got {got}{hint}")


# ---- 02.assign_buckets ---------------------------------------------------------------


def _bucket_cases(quick: bool):
    gen = torch.Generator().manual_seed(3)
    yield [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)], 80
    yield [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)], 1
    yield [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)], 10**6
    yield [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)], 120
    yield [torch.zeros(4, 5), torch.zeros(3), torch.zeros(2, 2, 2)], 100
    yield [torch.zeros(n, dtype=torch.bfloat16) for n in (40, 40, 40)], 160  # 80 bytes each: bytes, not elements
    for _ in range(20 if quick else 200):
        sizes = torch.randint(1, 200, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        cap = int(torch.randint(4, 2000, (1,), generator=gen))
        yield [torch.zeros(int(n)) for n in sizes], cap
    yield list(GPT(CFG).parameters()), int(0.02 * 2**20)


def _describe(buckets, index):
    return [[index.get(id(p), "?") for p in b] for b in buckets]


@exercise("02.assign_buckets", points=1)
def test_assign_buckets(assign_buckets, quick: bool = True):
    assign_buckets = without_library(
        assign_buckets,
        [build_buckets],
        "02.assign_buckets",
        "walk the parameters in reverse and fill the buckets up to the cap",
    )
    for params, cap in _bucket_cases(quick):
        index = {id(p): i for i, p in enumerate(params)}
        expected = build_buckets(list(reversed(params)), cap)
        call = (
            f"assign_buckets(<{len(params)} tensors of "
            f"{[p.numel() * p.element_size() for p in params]} bytes>, bucket_cap_bytes={cap})"
        )
        got = call_learner(
            assign_buckets,
            list(params),
            cap,
            call=call,
            expected=f"the buckets (by parameter index) {_describe(expected, index)}",
        )
        assert got is not None, f"{call} returned None: return the list of buckets (lists of parameters)"
        got = [list(b) for b in got]
        for b in got:
            for p in b:
                assert id(p) in index, f"{call}: a bucket holds something that is not one of the parameters given"
        flat = [id(p) for b in got for p in b]
        assert sorted(flat) == sorted(index), (
            f"{call}: every parameter must be in exactly one bucket; got buckets (by index) {_describe(got, index)}"
        )
        assert flat == [id(p) for p in reversed(params)], (
            f"{call}: buckets must follow the reverse of the parameter order (the order backward produces "
            f"gradients); got {_describe(got, index)}, expected {_describe(expected, index)}"
        )
        if _describe(got, index) != _describe(expected, index):
            raise AssertionError(
                f"{call}: expected buckets (by parameter index) {_describe(expected, index)}, got "
                f"{_describe(got, index)}. Add each parameter to the current bucket, then close the bucket "
                "as soon as its bytes reach the cap (>= cap, as DDP does: a bucket may pass the cap by its "
                "last parameter); count bytes (numel x element_size), not elements"
            )
