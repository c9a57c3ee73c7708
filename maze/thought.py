"""The thought language: what an expert turn says it sees before it moves, written by SFT's experts
(``rl/experts.py``) and read by the rewards (``maze/rewards.py``), the step's metrics and
``bench/reading.py``. Writer and reader live here, together, so the wording changes in one place.

Three thoughts, one per turn, inside ``<think>…</think>`` before the action:

- ``<think>on the goal</think>`` on the goal cell (then ``stop``);
- ``<think>facing right; open up right</think>``: the heading (the last move that moved) and the open ways;
- with a lookahead K > 0, ``<think>open up down left; not down</think>``: the open ways, and those of them that
  enter a dead-end pocket at most K cells deep (``maze.core.dead_ends``), instead of the heading.
"""

from __future__ import annotations

import re

from maze.core import MOVES, Maze, dead_ends
from maze.env import parse_action

_NAMED_POCKETS = re.compile(r"not ([a-z ]+)</think>")
_NAMED_OPEN = re.compile(r"open ([a-z ]+?)(;|</think>)")


# ---------------------------------------------------------------- writer
def open_ways(maze: Maze, position: tuple[int, int]) -> list[str]:
    """The ways out of ``position`` onto a floor cell, in ``MOVES`` order."""
    r, c = position
    return [m for m, (dr, dc) in MOVES.items() if maze.is_floor((r + dr, c + dc))]


def thought(maze: Maze, position: tuple[int, int], facing: str, lookahead: int = 0) -> str:
    """The expert's perception of its cell: the goal, or its heading and the open directions; with ``lookahead``
    > 0, the open directions and those of them that enter a dead-end pocket at most ``lookahead`` cells deep
    (``<think>open up down left; not down</think>``, ``maze.core.dead_ends``) instead of the heading."""
    if position == maze.goal:
        return "<think>on the goal</think>"
    open_dirs = open_ways(maze, position)
    if lookahead > 0:
        closed = dead_ends(maze, position, lookahead)
        return f"<think>open {' '.join(open_dirs)}{'; not ' + ' '.join(closed) if closed else ''}</think>"
    return f"<think>facing {facing}; open {' '.join(open_dirs)}</think>"


def pockets(maze: Maze, position: tuple[int, int], lookahead: int) -> set[str]:
    """The ways ``thought(..., lookahead)`` names as pockets at ``position`` (none on the goal): the truth a
    reader's ``named_pockets`` is scored against."""
    return set() if tuple(position) == tuple(maze.goal) else set(dead_ends(maze, position, lookahead))


def reading_target(maze: Maze, position: tuple[int, int], lookahead: int) -> list[float]:
    """What a reader of the agent's cell sees, as 8 numbers in ``MOVES`` order: whether each way is open, then
    whether it enters a dead-end pocket at most ``lookahead`` cells deep (the truths the lookahead thought names:
    ``open_ways``, ``pockets``). SFT's visual auxiliary target (``algo.sft_aux_weight``)."""
    ways, closed = open_ways(maze, position), pockets(maze, position, lookahead)
    return [float(m in ways) for m in MOVES] + [float(m in closed) for m in MOVES]


# ---------------------------------------------------------------- reader
def named_pockets(text: str) -> set[str]:
    """The ways a lookahead thought in ``text`` calls pockets (``<think>open up down; not down</think>``); a
    thought that names none, or no well-formed thought, names the empty set."""
    said = _NAMED_POCKETS.search(text)
    return set(said.group(1).split()) if said else set()


def named_open(text: str) -> list[str]:
    """The ways a thought in ``text`` calls open, in the order it names them (empty without a thought)."""
    said = _NAMED_OPEN.search(text)
    return said.group(1).split() if said else []


def first_move(text: str) -> str | None:
    """The turn's first move as the environment parses it (synonyms included), or None for an invalid action."""
    moves = parse_action(text, max_moves=1 << 10).moves
    return moves[0] if moves else None


def against_thought(text: str) -> bool:
    """Whether the turn's first move goes into a way its own thought called a pocket
    (``<think>open up down; not down</think><action>down</action>``): a policy that reads but does not act."""
    move = first_move(text)
    return move is not None and move in named_pockets(text)
