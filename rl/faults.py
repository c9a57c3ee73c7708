"""Fault injection for the fault-tolerance tests: ``VLMAZE_FAULTS="nan_loss@2,kill_in_save@3"``.

Each entry is ``NAME@STEP``; ``active(NAME, step)`` is true when it is listed. Unset (the normal
case) costs one dict lookup. Faults: ``nan_loss`` (the step's loss becomes NaN), ``kill_in_save``
(SIGKILL half-way through writing that step's checkpoint).
"""

from __future__ import annotations

import os


def _parse(spec: str) -> set[tuple[str, int]]:
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, step = item.partition("@")
        out.add((name, int(step)))
    return out


def active(name: str, step: int) -> bool:
    spec = os.environ.get("VLMAZE_FAULTS")
    return bool(spec) and (name, int(step)) in _parse(spec)
