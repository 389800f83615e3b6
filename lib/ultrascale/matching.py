"""Matching a plan to a model's module names: the one set of rules every technique uses.

A plan is a dict ``{module-name pattern: style}``, as torchtitan's ``parallelize_module``
plans are: ``{"blocks.*.attn.q": "colwise"}`` for tensor parallelism, ``{"blocks.*":
"unit"}`` for ZeRO, ``{"blocks.*": "tensorwise"}`` for FP8. ``match_plan`` turns it into
the modules it names, and the rules are these:

* **Glob syntax** (``fnmatch``, case-sensitive) over the names of ``model.named_modules()``.
  ``*`` matches any run of characters, dots included: ``"blocks.*"`` names every module
  under ``blocks`` (``blocks.0``, ``blocks.0.attn``, ``blocks.0.attn.q``, ...), and
  ``"blocks.*.attn"`` each block's attention. The model itself (name ``""``) is named only by
  the pattern ``""``, so that a technique can be applied to a bare layer
  (``apply_ep(moe_layer, plan={"": "ep"})``) while ``"*"`` still means "every submodule".
* **The first pattern wins.** When several patterns name a module, its style is that of the
  first one in the plan's order; the order of a dict is part of the plan.
* **The modules come in the model's order** (``named_modules``: a parent before its children),
  whatever the order of the patterns.
* **A pattern that names nothing is an error** that says which pattern and shows some
  module names (usually a plan written for another model, or a typo), unless the technique
  says a pattern may match nothing (``may_match_nothing``).

Three choices belong to the technique, each a parameter named for why:

* ``kind``: only modules of this exact type are candidates (FP8 converts ``nn.Linear``, EP
  splits ``MoE`` layers); the others are skipped, not refused.
* ``children``: a pattern that names a module also names the modules inside it (FP8:
  ``{"blocks.0": ...}`` converts every linear of block 0).
* ``outermost``: a module inside one already matched is left out, as it is part of it (ZeRO:
  a unit is gathered as a whole, so units do not nest).

What a style means, and which modules a style may be applied to, stays with the technique.
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

__all__ = ["match_plan"]


def _names(name: str, children: bool) -> list[str]:
    """The names a pattern may match for module ``name``: its own, and with ``children``
    those of the modules it is inside (``blocks.0.attn.q`` -> ``blocks.0.attn``, ``blocks.0``, ...)."""
    if not children or not name:
        return [name]
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


def _names_it(pattern: str, name: str) -> bool:
    """Does ``pattern`` name the module called ``name``? Only ``""`` names the model itself."""
    return pattern == name if not (name and pattern) else fnmatch.fnmatchcase(name, pattern)


def _kind_name(kind) -> str:
    if kind is None:
        return "module"
    return f"nn.{kind.__name__}" if kind.__module__.startswith("torch.nn") else kind.__name__


def match_plan(
    model: nn.Module,
    plan: dict,
    *,
    kind: type | None = None,
    children: bool = False,
    outermost: bool = False,
    may_match_nothing: bool = False,
) -> list[tuple[str, nn.Module, object]]:
    """``[(name, module, style)]``: the modules of ``model`` that ``plan`` names, in the
    model's order, each with the style of the first pattern that names it (rules above)."""
    candidates = [
        (name, m) for name, m in model.named_modules() if (name or "" in plan) and (kind is None or type(m) is kind)
    ]
    used, matched, taken = set(), [], []
    for name, module in candidates:
        names = _names(name, children)
        hits = [p for p in plan if any(_names_it(p, n) for n in names)]
        used.update(hits)
        if not hits or (outermost and any(outer == "" or name.startswith(outer + ".") for outer in taken)):
            continue
        matched.append((name, module, plan[hits[0]]))
        taken.append(name)
    unused = [p for p in plan if p not in used]
    if unused and not may_match_nothing:
        what = _kind_name(kind)
        some = [name for name, _ in candidates][:8]
        raise ValueError(
            f"plan pattern {unused[0]!r} matches no {what} of this {type(model).__name__} "
            f"(is the plan for another model?); its {what} names include {some}"
        )
    return matched
