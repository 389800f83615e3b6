"""The parity harness itself: seeded data and its slices, the one training loop, the comparisons."""

import pytest
import torch

from ultrascale.data import Batch, Batches, micro_batches, sequence_positions, split
from ultrascale.model import GPT, GPTConfig
from ultrascale.parity import assert_replicas_identical, assert_same, max_difference, tolerance
from ultrascale.train import gradients, make_optimizer, train, weights

CFG = GPTConfig(vocab_size=50, hidden=16, layers=1, heads=2, seq_len=12)
DATA = Batches(CFG, mbs=2, seed=3)


def fresh():
    torch.manual_seed(0)
    return GPT(CFG)


def test_batches_are_seeded_and_ranks_tile_the_global_batch():
    a, b = DATA.global_batch(1, 3), DATA.global_batch(1, 3)
    assert torch.equal(a.inputs, b.inputs) and a.inputs.shape == (6, 12)
    assert torch.equal(a.targets[:, :-1], a.inputs[:, 1:])  # next-token targets
    assert not torch.equal(DATA.global_batch(2, 3).inputs, a.inputs)  # another step, other tokens
    assert not torch.equal(DATA.global_batch(1, 3, micro=1).inputs, a.inputs)
    rows = [DATA.rank_batch(r, 3, 1).inputs for r in range(3)]
    assert torch.equal(torch.cat(rows), a.inputs)
    assert torch.equal(DATA.rank_stream(2, 3)(1).inputs, rows[2])


def test_sequence_split_keeps_global_positions():
    batch = DATA.global_batch(0)
    pieces = [split(batch, r, 3, by="sequence") for r in range(3)]
    assert torch.equal(torch.cat([p.inputs for p in pieces], dim=1), batch.inputs)
    assert [p.positions.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    model = fresh()
    # causal attention: the first slice sees nothing of the rest, so its logits are the full run's
    torch.testing.assert_close(model(pieces[0].inputs, pieces[0].positions), model(batch.inputs)[:, :4])
    with pytest.raises(ValueError, match="do not split evenly over 5 ranks"):
        split(batch, 0, 5, by="sequence")
    with pytest.raises(ValueError, match="by="):
        split(batch, 0, 2, by="heads")


def test_zigzag_sequence_split_pairs_an_early_chunk_with_a_late_one():
    batch = DATA.global_batch(0)  # 12 tokens: 6 chunks of 2 over 3 ranks
    pieces = [split(batch, r, 3, by="sequence", layout="zigzag") for r in range(3)]
    assert [p.positions.tolist() for p in pieces] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    for p in pieces:  # the tokens and targets at those positions
        assert torch.equal(p.inputs, batch.inputs[:, p.positions])
        assert torch.equal(p.targets, batch.targets[:, p.positions])
    assert torch.equal(DATA.rank_stream(1, 3, by="sequence", layout="zigzag")(0).positions, pieces[1].positions)
    assert [sequence_positions(12, r, 2).tolist() for r in range(2)] == [list(range(6)), list(range(6, 12))]
    with pytest.raises(ValueError, match="pad the sequence to 16 tokens or choose a length that 8 divides"):
        split(batch, 0, 4, by="sequence", layout="zigzag")
    with pytest.raises(ValueError, match="7 ranks need more chunks than a sequence of 12 tokens has"):
        split(batch, 0, 7, by="sequence", layout="zigzag")


def test_micro_batches_cut_rows():
    batch = DATA.global_batch(0, 4)
    parts = micro_batches(batch, 4)
    assert [p.inputs.shape[0] for p in parts] == [2] * 4
    assert torch.equal(torch.cat([p.targets for p in parts]), batch.targets)
    with pytest.raises(ValueError, match="equal micro-batches"):
        micro_batches(batch, 3)


def test_accumulation_over_micro_batches_equals_the_whole_batch():
    """The identity data parallelism rests on, in one process: the loop's grad_acc divides right."""
    whole = train(fresh(), DATA.global_stream(4), 2, "sgd")
    accumulated = train(fresh(), lambda step, micro: DATA.rank_batch(micro, 4, step), 2, "sgd", grad_acc=4)
    assert_same(accumulated, whole, "grad_acc 4 vs whole batch")
    summed = train(
        fresh(), lambda step, micro: DATA.rank_batch(micro, 4, step), 2, "sgd", grad_acc=1
    )  # only the first quarter: a different (wrong) gradient
    with pytest.raises(AssertionError, match="grad_acc"):
        assert_same(summed, whole, "grad_acc")


def test_assert_same_fails_on_plausible_wrong_answers():
    reference = train(fresh(), DATA.global_stream(2), 3, "sgd")
    assert_same(reference, reference)
    # summed instead of averaged over 2 ranks: SGD with twice the learning rate
    model = fresh()
    doubled = train(model, DATA.global_stream(2), 3, make_optimizer(model.parameters(), "sgd", lr=0.2))
    with pytest.raises(AssertionError, match="sum check"):
        assert_same(doubled, reference, "sum check")
    assert max_difference(doubled, reference) > 100 * tolerance("sgd")["atol"]
    one_step = train(fresh(), DATA.global_stream(2), 2, "sgd")  # a lost step
    with pytest.raises(AssertionError):
        assert_same(one_step, reference)
    with pytest.raises(AssertionError, match="missing"):
        assert_same({k: v for k, v in reference.items() if k != "embed.weight"}, reference)
    assert_replicas_identical([reference, dict(reference)])
    with pytest.raises(AssertionError, match="rank 1"):
        assert_replicas_identical([reference, doubled])


def test_tolerances_are_stated_per_dtype_and_optimizer():
    assert tolerance("sgd")["atol"] < tolerance("adam")["atol"]  # Adam magnifies rounding
    assert tolerance("adamw") == tolerance("adam")
    assert tolerance("sgd", torch.float64)["atol"] < 1e-9
    assert_same(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64) + 1e-13)
    with pytest.raises(AssertionError):
        assert_same(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64) + 1e-9)
    with pytest.raises(ValueError, match="no tolerance stated"):
        tolerance("sgd", torch.float16)
    with pytest.raises(ValueError, match="optimizer="):
        make_optimizer([torch.zeros(1, requires_grad=True)], "lion")


def test_weights_and_gradients_are_plain_cpu_copies():
    model = fresh()
    assert all(g is None for g in gradients(model).values())
    DATA.global_batch(0).loss(model).backward()
    grads, params = gradients(model), weights(model)
    assert set(grads) == set(params) == {n for n, _ in model.named_parameters()}
    params["embed.weight"].zero_()  # a copy: the model is untouched
    assert model.embed.weight.abs().sum() > 0
    assert isinstance(Batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)).to("cpu"), Batch)


def test_refusal_returns_the_refused_message_and_fails_when_nothing_is_refused():
    from ultrascale.refusal import refusal

    def bad():
        raise ValueError("cp=3 does not divide 8 chunks")

    assert refusal(bad) == "ValueError: cp=3 does not divide 8 chunks"
    with pytest.raises(AssertionError, match="accepted"):
        refusal(lambda: 42)  # accepted: a chapter must not print a refusal
    with pytest.raises(KeyError):
        refusal(lambda: {}["x"])  # another error is a bug, not a refusal
    assert refusal(lambda: {}["x"], KeyError) == "KeyError: 'x'"
