"""Properties of the exercises that are formulas, counts and schedules (no ranks): each drawn
input is checked against the library's own function for the same quantity (see
``exercise_tests.properties`` for how they run)."""

from __future__ import annotations

PROPERTIES: dict = {}
