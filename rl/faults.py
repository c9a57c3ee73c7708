"""Fault injection for the fault-tolerance tests: ``VLMAZE_FAULTS="nan_loss@2,kill_in_save@3"``.

Each entry is ``NAME@STEP`` (or ``NAME@all``); ``active(NAME, step)`` is true when it is listed. Unset
(the normal case) costs one dict lookup. Faults: ``nan_loss`` (the step's loss becomes NaN), ``kill_in_save``
(SIGKILL half-way through writing that step's checkpoint), ``flip_advantage`` (the advantages change sign:
the learning regression test must then fail), ``kill_last_rank`` (SIGKILL of the last rank at the start of that
step, between two checkpoints), ``uniform_rewards_last_rank`` (the last rank's rewards all become 0).
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str) -> set[tuple[str, int]]:
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, step = item.partition("@")
        out.add((name, ALL if step == "all" else int(step)))
    return out


ALL = -1  # NAME@all


def schedule() -> frozenset[tuple[str, int]]:
    """The listed faults as ``(name, step)`` pairs (step ``ALL`` for every step), read once at start."""
    return frozenset(_parse(os.environ.get("VLMAZE_FAULTS") or ""))


def active(name: str, step: int) -> bool:
    spec = os.environ.get("VLMAZE_FAULTS")
    if not spec:
        return False
    parsed = _parse(spec)
    return (name, int(step)) in parsed or (name, -1) in parsed


def due(listed: frozenset[tuple[str, int]], step: int, rank: int, world: int) -> set[str]:
    """The faults ``schedule()`` listed for ``step``; ``kill_last_rank`` is carried out here, on the last rank."""
    names = {name for name, at in listed if at in (step, ALL)}
    if "kill_last_rank" in names and rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run, between two checkpoints
    return names
