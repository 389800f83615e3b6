"""Properties of ``11.masked_add``, ``11.matmul_tile``, ``06.ring_step`` and
``a1.communication_overlap`` (issue 53's last ones but the training steps)."""

from __future__ import annotations

PROPERTIES: dict = {}
