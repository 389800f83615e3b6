"""Properties of the exercises that are a whole training step on ranks (issue 53's last ones):
``02.overlapped_dp_hooks``, ``03.zero1_step``, ``03.zero3_gather_free`` and ``07.stage_step``.
Each drawn case is a short run on ranks, so each property draws few cases (``draws``)."""

from __future__ import annotations

PROPERTIES: dict = {}
