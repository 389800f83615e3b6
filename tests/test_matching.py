"""``matching.match_plan``: the one set of rules by which every technique reads a plan."""

import pytest
import torch.nn as nn

from ultrascale.matching import match_plan


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.q, self.attn.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10)


def names(matched):
    return [name for name, _, _ in matched]


def test_glob_star_crosses_dots_and_never_names_the_model_itself():
    model = Toy()
    assert names(match_plan(model, {"blocks.*.attn": "a"})) == ["blocks.0.attn", "blocks.1.attn"]
    assert "blocks.0.mlp.1" in names(match_plan(model, {"blocks.*": "a"}))  # * matches "0.mlp.1"
    assert "" not in names(match_plan(model, {"*": "a"}))
    assert names(match_plan(model, {"Head": "a"}, may_match_nothing=True)) == []  # case-sensitive


def test_only_the_empty_pattern_names_the_model_itself():
    """A technique applied to a bare layer names it "" (bench_ep: ``apply_ep(moe, plan={"": "ep"})``)."""
    from ultrascale.model import MLP, GPTConfig
    from ultrascale.moe import MoE

    model = Toy()
    assert names(match_plan(model, {"": "a"})) == [""]
    assert names(match_plan(model, {"": "a", "embed": "b"})) == ["", "embed"]
    assert names(match_plan(model, {"": "a", "blocks.*": "b"}, outermost=True)) == [""]  # all inside it
    assert "head" in names(match_plan(model, {"": "a"}, kind=nn.Linear, children=True))  # "" holds all
    cfg = GPTConfig(hidden=8, heads=2, layers=1, experts=2, top_k=1)
    moe = MoE(cfg.hidden, cfg, lambda: MLP(cfg.hidden))
    assert match_plan(moe, {"": "ep"}, kind=MoE) == [("", moe, "ep")]  # what apply_ep matches


def test_modules_come_in_model_order_and_the_first_pattern_wins():
    model = Toy()
    matched = match_plan(
        model, {"head": "h", "blocks.0.attn.*": "specific", "blocks.*.attn.*": "general", "embed": "e"}
    )
    assert names(matched) == [
        "embed",
        "blocks.0.attn.q",
        "blocks.0.attn.k",
        "blocks.1.attn.q",
        "blocks.1.attn.k",
        "head",
    ]
    styles = {name: style for name, _, style in matched}
    assert styles["blocks.0.attn.q"] == "specific" and styles["blocks.1.attn.q"] == "general"
    reordered = {
        name: style
        for name, _, style in match_plan(model, {"blocks.*.attn.*": "general", "blocks.0.attn.*": "specific"})
    }
    assert reordered["blocks.0.attn.q"] == "general"
    assert matched[0][1] is model.embed  # the module itself, not a copy


def test_a_pattern_that_names_nothing_is_an_error_naming_it_and_some_modules():
    with pytest.raises(ValueError) as err:
        match_plan(Toy(), {"blocks.*.attn": "a", "blocks.*.mlp.gate": "b"})
    assert "'blocks.*.mlp.gate' matches no module of this Toy" in str(err.value)
    assert "'embed'" in str(err.value)
    # A pattern counts as matching even where an earlier pattern wins the module.
    assert len(match_plan(Toy(), {"blocks.*": "a", "blocks.0": "b"})) > 0
    assert match_plan(Toy(), {"nothing.*": "a"}, may_match_nothing=True) == []


def test_kind_keeps_modules_of_that_exact_type_and_names_it_in_the_error():
    model = Toy()
    assert names(match_plan(model, {"blocks.0.*": "a"}, kind=nn.LayerNorm)) == ["blocks.0.norm"]
    assert all(type(m) is nn.Linear for _, m, _ in match_plan(model, {"*": "a"}, kind=nn.Linear))
    with pytest.raises(ValueError, match="'embed' matches no nn.Linear"):
        match_plan(model, {"embed": "a"}, kind=nn.Linear)


def test_children_fp8_a_pattern_names_the_modules_inside_what_it_names():
    model = Toy()
    inside = names(match_plan(model, {"blocks.0": "a"}, kind=nn.Linear, children=True))
    assert inside == ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.mlp.0", "blocks.0.mlp.1"]
    with pytest.raises(ValueError, match="matches no nn.Linear"):  # blocks.0 itself is no linear
        match_plan(model, {"blocks.0": "a"}, kind=nn.Linear)


def test_outermost_zero_units_do_not_nest():
    model = Toy()
    assert names(match_plan(model, {"blocks.*": "unit"}, outermost=True)) == ["blocks.0", "blocks.1"]
    assert len(match_plan(model, {"blocks.*": "unit"})) > 2  # without it, everything inside too


def test_each_technique_reads_its_plan_through_match_plan():
    from ultrascale.parallel.zero import units_of
    from ultrascale.precision import FP8Linear, apply_fp8

    model = Toy()
    assert units_of(model, {"blocks.1": "unit", "blocks.1.attn": "unit"}) == [model.blocks[1]]
    assert units_of(model, {"nothing": "unit"}) == []  # ZeRO: what no unit claims is the root unit
    apply_fp8(model, plan={"blocks.1": "tensorwise"})
    assert [n for n, m in model.named_modules() if isinstance(m, FP8Linear)] == [
        "blocks.1.attn.q",
        "blocks.1.attn.k",
        "blocks.1.mlp.0",
        "blocks.1.mlp.1",
    ]
    with pytest.raises(ValueError, match="'embed' matches no nn.Linear"):
        apply_fp8(Toy(), plan={"blocks.*": "tensorwise", "embed": "tensorwise"})
