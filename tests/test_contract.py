"""Issue 53, item 1: the contract every learner function is held to (``grading.contract``).

Wrong answers of each kind the contract exists for, written as a learner might and different from
the issue's examples, are submitted to the exercises they fit (off a rank: seconds), and each must
fail with a message that names the mistake; the solutions pass (the graded course checks all of
them under the contract, tests/conftest.py). The contract's own pieces are tested on plain
functions first.
"""

from __future__ import annotations

import inspect
import math

import nbformat
import pytest
import torch
from test_grader_holes import SOLUTIONS, _fails, _load

from ultrascale_grading import PASS, check
from ultrascale_grading.contract import CONTRACTS, Contract, guarded, run_deferred


# ---- the pieces, on plain functions ------------------------------------------------------


def test_a_function_that_keeps_its_inputs_and_returns_new_storage_passes():
    def double(x, xs, table):
        return x * 2, sorted(xs), dict(table)

    out = guarded(double, "xx.double")(torch.ones(3), [3, 1, 2], {"a": 1})
    assert out[1] == [1, 2, 3]


@pytest.mark.parametrize(
    "body, phrases",
    [
        (lambda x, xs, table: x.mul_(2), ["changed its argument `x`", "3 of its 3 values changed"]),
        (lambda x, xs, table: xs.sort(), ["changed its argument `xs`", "reordered in place"]),
        (lambda x, xs, table: xs.append(0), ["`xs`", "length went from 3 to 4"]),
        (lambda x, xs, table: table.setdefault("b", 0), ["`table`", "'b' added"]),
        (lambda x, xs, table: table.update(a=5), ["`table`['a']", "from 1 to 5"]),
        (lambda x, xs, table: x[1:].zero_(), ["`x`", "2 of its 3 values changed"]),
        (lambda x, xs, table: x.unsqueeze_(0), ["`x`", "shape went from (3,) to (1, 3)"]),
    ],
)
def test_changing_an_input_is_named(body, phrases):
    def learner(x, xs, table):
        body(x, xs, table)
        return 0

    with pytest.raises(AssertionError) as err:
        guarded(learner, "xx.mutate")(torch.ones(3), [3, 1, 2], {"a": 1})
    for phrase in phrases:
        assert phrase in str(err.value), str(err.value)


def test_returning_a_view_of_an_input_or_a_parameter_is_named():
    layer = torch.nn.Linear(2, 3)
    for learner, phrase in [
        (lambda x, model: x.view(-1), "argument `x`"),
        (lambda x, model: x[::2], "argument `x`"),
        (lambda x, model: (x + 1, [model.weight.detach().t()]), "`model.weight`"),
    ]:
        with pytest.raises(AssertionError, match="shares memory") as err:
            guarded(learner, "xx.view")(torch.ones(4), layer)
        assert phrase in str(err.value)
    # allowed where the exercise says so
    assert guarded(lambda x, model: x, "xx.view", Contract(returns_inputs=True))(torch.ones(1), layer) is not None


def test_gradients_an_exercise_updates_may_change_but_not_the_values():
    layer = torch.nn.Linear(2, 1)

    def accumulate(model):
        model(torch.ones(1, 2)).sum().backward()

    guarded(accumulate, "xx.grad", Contract(updates=("model.grad",)))(layer)
    assert layer.weight.grad is not None

    def step_too(model):
        accumulate(model)
        with torch.no_grad():
            model.weight -= 0.1

    with pytest.raises(AssertionError, match="`model`.weight"):
        guarded(step_too, "xx.grad", Contract(updates=("model.grad",)))(layer)
    with pytest.raises(AssertionError, match=r"\.grad \(its gradient was changed"):
        guarded(accumulate, "xx.grad")(layer)  # not allowed by default


def test_state_kept_between_calls_is_found():
    def memo(n, seen={}):  # noqa: B006 (the mistake under test)
        seen.setdefault(n, n * n)
        return seen[n]

    with pytest.raises(AssertionError, match="default argument `seen`"):
        guarded(memo, "xx.state")(3)

    calls = []

    def counting(n):  # an answer that drifts with a global counter
        calls.append(n)
        return n + len(calls)

    answer = guarded(counting, "xx.state")
    answer(3)  # the second call is made once the exercise's cases pass
    with pytest.raises(AssertionError, match="called a second time with the same inputs"):
        run_deferred((answer,), {})


def test_a_generator_where_the_exercise_takes_any_iterable():
    def twice_through(xs):
        return max(xs) - min(xs)  # the second pass finds a spent generator

    contract = Contract(iterables=("xs",))
    answer = guarded(twice_through, "xx.iter", contract)
    assert answer([1, 5, 2]) == 4
    with pytest.raises(AssertionError, match="`xs` came as a generator"):
        run_deferred((answer,), {})
    fixed = guarded(lambda xs: (lambda v: max(v) - min(v))(list(xs)), "xx.iter", contract)
    assert fixed([1, 5, 2]) == 4
    run_deferred((fixed,), {})


def test_every_allowance_names_a_real_argument_of_the_solution():
    """A typo in CONTRACTS would silently allow nothing; each name must be a parameter of one of
    the solution's functions for that exercise."""
    sources = {nb.name[:2]: nbformat.read(nb, as_version=4) for nb in SOLUTIONS.glob("*.ipynb")}
    for exercise_id, contract in CONTRACTS.items():
        chapter = exercise_id.split(".")[0]
        code = "\n".join(c.source for c in sources[chapter].cells if c.cell_type == "code")
        for name in contract.updates + contract.iterables:
            assert f"{name.split('.')[0]}" in code, (exercise_id, name)
        assert contract != Contract(), exercise_id


# ---- wrong answers submitted to the exercises ---------------------------------------------


@pytest.fixture(scope="module")
def sol():
    found = {}
    for chapter in (
        "03_zero",
        "07_pipeline_parallelism",
        "10_best_configuration",
        "12_mixed_precision",
        "02_data_parallelism",
        "06_context_parallelism",
    ):
        found.update(_load(f"{chapter}_exercises.ipynb"))
    return found


def test_the_solutions_pass_under_the_contract(sol):
    for exercise, name in [
        ("03.flatten_padded", "flatten_padded"),
        ("12.quantize_per_tensor", "quantize_per_tensor"),
        ("07.bubble_fraction", "bubble"),
        ("10.memory_filter", "fitting"),
        ("02.assign_buckets", "assign_buckets"),
        ("06.merge_partial_attention", "merge_attention"),
    ]:
        assert check(exercise, sol[name], quick=True).status == PASS, exercise


def test_kind_1_inputs_changed_in_place(sol):
    def flatten_by_appending(tensors, world_size):  # pads the caller's list itself
        n = sum(t.numel() for t in tensors)
        tensors.append(torch.zeros(-n % world_size, dtype=tensors[0].dtype))
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def quantize_in_place(x, dtype=torch.float8_e4m3fn):  # scales the caller's tensor
        fp8_max = torch.finfo(dtype).max
        scale = x.detach().abs().max().float().clamp(min=1e-12) / fp8_max
        with torch.no_grad():
            x /= scale
        return x.detach().float().clamp(-fp8_max, fp8_max).to(dtype), scale

    def bubble_sorting_each_rank(spans):  # puts each rank's spans in time order
        for rank in spans:
            rank.sort()
        return sol["bubble"]([list(r) for r in spans])

    def fitting_sorted_by_size(model, configs, seq, memory_bytes, headroom):
        configs.sort(key=lambda c: (c.tp, c.pp))  # the caller's list, sorted in place
        return sol["fitting"](model, list(configs), seq, memory_bytes, headroom)

    _fails(
        check("03.flatten_padded", flatten_by_appending, quick=True),
        "changed its argument `tensors`",
        "length went from",
    )
    _fails(check("12.quantize_per_tensor", quantize_in_place, quick=True), "changed its argument `x`", "values changed")
    _fails(
        check("07.bubble_fraction", bubble_sorting_each_rank, quick=True),
        "changed its argument `spans`",
        "reordered in place",
    )
    result = check("10.memory_filter", fitting_sorted_by_size, quick=True)
    _fails(result, "changed its argument `configs`")


def test_kind_2_a_view_where_new_storage_is_promised(sol):
    def flatten_viewing_one_tensor(tensors, world_size):  # no copy when nothing needs padding
        tensors = list(tensors)
        if len(tensors) == 1 and tensors[0].numel() % world_size == 0:
            return tensors[0].detach().view(-1)
        return sol["flatten_padded"](tensors, world_size)

    def merge_skipping_an_empty_part(out_a, lse_a, out_b, lse_b):  # hands back part a itself
        if torch.isneginf(lse_b).all():
            return out_a, lse_a
        return sol["merge_attention"](out_a, lse_a, out_b, lse_b)

    for exercise, learner in [
        ("03.flatten_padded", flatten_viewing_one_tensor),
        ("06.merge_partial_attention", merge_skipping_an_empty_part),
    ]:
        _fails(check(exercise, learner, quick=True), "shares memory with its argument")


def test_kind_7_state_across_calls(sol):
    def one_f_one_b_memo(p, m, rank, _memo={}):  # noqa: B006 (the mistake under test)
        if (p, rank) not in _memo:  # keyed without m: wrong for the next m
            _memo[(p, rank)] = sol["one_f_one_b_list"](p, m, rank)
        return list(_memo[(p, rank)])

    asked = {}

    def bubble_remembering_questions(spans):  # a global cache whose hits drift
        key = repr(spans)
        asked[key] = asked.get(key, 0) + 1  # the fixed cases never ask twice
        return sol["bubble"](spans) * (1 if asked[key] == 1 else 1.0001)

    _fails(check("07.one_f_one_b", one_f_one_b_memo, quick=True), "default argument `_memo`")
    _fails(
        check("07.bubble_fraction", bubble_remembering_questions, quick=True),
        "called a second time with the same inputs",
    )


def test_a_generator_of_parameters_is_a_valid_input(sol):
    def buckets_reversing_a_list(params, bucket_cap_bytes):  # reversed() needs a sequence
        buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_bytes:
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    def flatten_counting_first(tensors, world_size):  # len() of a generator
        assert len(tensors) >= 0
        return sol["flatten_padded"](tensors, world_size)

    _fails(check("02.assign_buckets", buckets_reversing_a_list, quick=True), "`params` came as a generator")
    _fails(check("03.flatten_padded", flatten_counting_first, quick=True), "`tensors` came as a generator")


def test_the_contract_is_part_of_every_registered_test():
    from ultrascale_grading.registry import get_exercise, load_all, _REGISTRY

    load_all()
    for exercise_id in _REGISTRY:
        test = get_exercise(exercise_id).test
        assert test.__code__.co_name == "test_under_contract" and inspect.unwrap(test) is not test, exercise_id


# ---- issue 53 item 2: property-based cases (grading/properties.py, exercise_tests/properties.py) --


@pytest.fixture(scope="module")
def more():
    found = {}
    for chapter in ("08_expert_parallelism", "09_5d_parallelism", "11_gpu_kernels"):
        found.update(_load(f"{chapter}_exercises.ipynb"))
    return found


def test_the_solutions_pass_their_properties(more):
    for exercise, name in [
        ("08.router", "route"),
        ("09.group_ranks", "group_ranks"),
        ("11.online_softmax_update", "online_softmax_update"),
    ]:
        assert check(exercise, more[name], quick=True).status == PASS, exercise


def test_kind_3_assuming_the_tested_dtypes_and_shapes(sol, more):
    def flatten_in_float32(tensors, world_size):  # a buffer made without a dtype
        tensors = list(tensors)
        n = sum(t.numel() for t in tensors)
        flat = torch.zeros(n + (-n % world_size))
        flat[:n] = torch.cat([t.detach().reshape(-1) for t in tensors])
        return flat

    def flatten_with_view(tensors, world_size):  # view() needs contiguous memory
        flat = torch.cat([t.detach().view(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])

    def group_ranks_of_two_axes(sizes, axis):  # a joint group of at most two axes
        order = [a for a in ("dp", "pp", "ep", "cp", "tp") if a in sizes]
        grid = torch.arange(math.prod(sizes.values())).view([sizes[a] for a in order])
        if isinstance(axis, str):
            dims = [order.index(axis)]
        else:
            first, second = axis
            dims = sorted([order.index(first), order.index(second)])
        others = [d for d in range(len(order)) if d not in dims]
        return grid.permute(others + dims).reshape(-1, math.prod(grid.shape[d] for d in dims)).tolist()

    _fails(check("03.flatten_padded", flatten_in_float32, quick=True), "torch.bfloat16", "float32")
    _fails(check("03.flatten_padded", flatten_with_view, quick=True), "transposed views", "raised RuntimeError")
    _fails(
        check("09.group_ranks", group_ranks_of_two_axes, quick=True),
        "an input they do not cover",
        "raised ValueError: too many values to unpack",
    )


def test_kind_4_numerically_unstable(sol, more):
    def merge_by_plain_exps(out_a, lse_a, out_b, lse_b):  # exp(lse) overflows for large scores
        w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
        total = w_a + w_b
        safe = torch.where(total > 0, total, torch.ones_like(total))
        out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe[..., None]
        return torch.where((total > 0)[..., None], out, torch.zeros_like(out)), torch.log(total)

    def route_by_plain_exps(logits, k):  # a softmax without the row's maximum
        e = torch.exp(logits)
        probs = e / e.sum(-1, keepdim=True)
        top, chosen = probs.topk(k, dim=-1)
        return (top if k == 1 else top / top.sum(-1, keepdim=True)), chosen

    def online_by_ratio(m, l, acc, s_block, v_block):  # exp(s) / exp(m): both overflow
        m_new = torch.maximum(m, s_block.max(dim=1).values)
        alpha = torch.exp(m) / torch.exp(m_new)
        alpha = torch.where(torch.isneginf(m), torch.zeros_like(alpha), alpha)
        p = torch.exp(s_block) / torch.exp(m_new)[:, None]
        return m_new, alpha * l + p.sum(dim=1), alpha[:, None] * acc + p @ v_block

    for exercise, learner, phrase in [
        ("06.merge_partial_attention", merge_by_plain_exps, "overflow"),
        ("08.router", route_by_plain_exps, "overflow"),
        ("11.online_softmax_update", online_by_ratio, "inf or NaN"),
    ]:
        result = check(exercise, learner, quick=True)
        _fails(result, phrase)


def test_kind_5_constants_that_fit_the_fixed_cases(sol):
    def quantize_with_e4m3s_max(x, dtype=torch.float8_e4m3fn):  # 448 whatever the format
        scale = x.detach().abs().max().float().clamp(min=1e-12) / 448.0
        return (x.detach().float() / scale).clamp(-448.0, 448.0).to(dtype), scale

    def quantize_with_an_eps_floor(x, dtype=torch.float8_e4m3fn):  # float32's eps as the amax floor
        top = torch.finfo(dtype).max
        scale = x.detach().abs().max().float().clamp(min=torch.finfo(torch.float32).eps) / top
        return (x.detach().float() / scale).clamp(-top, top).to(dtype), scale

    _fails(check("12.quantize_per_tensor", quantize_with_e4m3s_max, quick=True), "e5m2", "57,344")
    _fails(
        check("12.quantize_per_tensor", quantize_with_an_eps_floor, quick=True),
        "values of size ~1e-",
        "largest |x| must land on",
    )


# ---- issue 53 item 3: the technique's collectives (contract.collectives, on the ranks) ------------


def test_the_right_numbers_through_another_collective_fail_naming_the_one_expected():
    import torch.distributed as dist

    def mean_by_all_gather(ctx, tensor):  # gathers N copies to average locally
        parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=ctx.group)
        return torch.stack(parts).mean(dim=0)

    def mean_by_broadcasts(ctx, tensor):  # every rank broadcasts its tensor in turn
        total = torch.zeros_like(tensor)
        for src in range(ctx.world_size):
            part = tensor.clone()
            dist.broadcast(part, src=src, group=ctx.group)
            total += part
        return total / ctx.world_size

    for wrong, used in [(mean_by_all_gather, "all_gather x1"), (mean_by_broadcasts, "broadcast x")]:
        _fails(check("00.mean_across_ranks", wrong, quick=True), used, "made of all_reduce", "another algorithm")


def test_the_exercise_texts_state_the_contract_and_each_allowance():
    """The contract is stated once in every exercise notebook's introduction, and each
    generator allowance in the exercise's own text (the check and the text say the same)."""
    import json

    for nb in sorted(SOLUTIONS.glob("*.ipynb")):
        intro = "".join(json.loads(nb.read_text())["cells"][0]["source"])
        assert "grading.contract" in intro and "leaves its inputs as they were" in intro, nb.name
    texts = {
        nb.name[:2]: "\n".join(
            "".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown"
        )
        for nb in SOLUTIONS.glob("*.ipynb")
    }
    for exercise_id, contract in CONTRACTS.items():
        text = texts[exercise_id.split(".")[0]]
        for name in contract.iterables:
            assert f"`{name}` may be any iterable" in text or f"`{name}` and" in text and "any iterables" in text, (
                exercise_id,
                name,
            )


def test_the_graders_ranks_under_strict_p2p_name_a_receive_buffer_of_the_wrong_dtype(monkeypatch, sol):
    """grading_cluster in strict p2p mode: a receive buffer of the wrong dtype is named as such,
    not as gloo's 'Connection reset by peer'."""
    import torch.distributed as dist

    monkeypatch.setenv("ULTRASCALE_STRICT_P2P", "1")  # as make test grades, and a learner may ask
    merge = sol["merge_attention"]

    def ring_step_float32_buffer(q, kv, out, lse, attend, group, last):
        works, incoming = [], None
        if not last:
            r, n = dist.get_rank(group), dist.get_world_size(group)
            incoming = torch.empty(kv.shape, device=kv.device)  # float32, whatever kv holds
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                    dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % n),
                ]
            )
        out, lse = merge(out, lse, *attend(q, kv[0], kv[1]))
        for work in works:
            work.wait()
        return out, lse, incoming

    _fails(
        check("06.ring_step", ring_step_float32_buffer, quick=True),
        "MessageMismatch",
        "torch.float32",
        "must agree on shape and dtype",
    )


def test_a_count_read_off_the_librarys_built_model_is_refused():
    """01.param_count: building the course GPT (on the meta device it costs nothing) and summing
    its parameters answers without counting; the model's classes are refused while it runs."""
    from ultrascale.model import GPT, GPTConfig

    def gpt_param_count(hidden, vocab, layers, tied=True):
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=vocab, hidden=hidden, layers=layers, heads=1))  # tied
        return sum(p.numel() for p in model.parameters()) + (0 if tied else hidden * vocab)

    _fails(check("01.param_count", gpt_param_count, quick=True), "ultrascale.model.GPT", "compute it yourself")
    GPT(GPTConfig(vocab_size=8, hidden=4, layers=1, heads=1))  # built again once the check is over
