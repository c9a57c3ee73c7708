"""Mazes as data: the grid, perfect-maze generators, start/goal placement, BFS, the frozen evaluation suites and
the training stream that never draws their layouts.

A maze is a *block* maze, as in the reference environment: walls are whole cells. A maze of
odd size N (5..31) holds an outer wall ring; the "rooms" sit at odd coordinates (r, c) and
the cells between two rooms are either wall or corridor. ``grid[r, c] == 1`` is a wall.

Generators carve a spanning tree over the (N-1)/2 x (N-1)/2 room lattice, so the floor is a
tree (a *perfect* maze: exactly one route between any two cells) unless ``braid > 0`` opens
extra walls at dead ends. Everything is a pure function of an integer seed.

The suites live in ``maze/data/eval_sets.json`` as text grids with content hashes, so they do
not drift when generator code changes. ``python -m maze --freeze`` rewrites that file
from ``SUITE_SPECS`` (only do this on purpose: it changes every reported number).

``fixed64`` is the reference's own evaluation set: the 64 mazes its environment (``maze_2d/easy``,
9x9 Wilson) produces for ``reset(seed=i)``, i = 0..63, each with its start and goal (one of four
corner pairs), copied in seed order from ``REFERENCE_FILE`` when freezing. ``select64`` is a second
set from the same distribution (vlmaze's Wilson generator, ``corners4``) for choosing recipes, so
``fixed64`` stays a test set. The other suites are held out from training: other sizes, each
generator, braided mazes (several routes, so loops are possible), all with the reference's four
corner pairs, and random placement. No two suites share a layout (grid), and training
(``TrainSampler``) never draws a layout that any suite holds, whatever its start and goal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

GENERATORS = ("wilson", "backtracker", "prim", "kruskal", "sidewinder")
PLACEMENTS = ("corners", "corners4", "random")
# The reference's four corner pairs (start, goal) as functions of the size: TL->BR, BR->TL, BL->TR, TR->BL.
CORNER_PAIRS = (("top_left", "bottom_right"), ("bottom_right", "top_left"),
                ("bottom_left", "top_right"), ("top_right", "bottom_left"))
MIN_SIZE, MAX_SIZE = 5, 31

WALL, FLOOR = 1, 0
# (d_row, d_col) of the four moves, in a fixed order used everywhere.
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


@dataclass(frozen=True)
class Maze:
    """An immutable maze. ``grid`` is (size, size) uint8, 1 = wall; positions are (row, col)."""

    grid: np.ndarray = field(repr=False)  # (size, size) uint8
    start: tuple[int, int]
    goal: tuple[int, int]
    seed: int
    generator: str
    braid: float = 0.0
    placement: str = "corners"

    def __post_init__(self):
        self.grid.setflags(write=False)

    @property
    def size(self) -> int:
        return int(self.grid.shape[0])

    def _digest(self, head: str) -> str:
        h = hashlib.sha256()
        h.update(head.encode())
        h.update(np.ascontiguousarray(self.grid, dtype=np.uint8).tobytes())
        return h.hexdigest()[:16]

    @property
    def layout_hash(self) -> str:
        """Stable hash of the grid alone: the same layout with another start or goal hashes the same."""
        return self._digest(f"{self.size}|")

    @property
    def content_hash(self) -> str:
        """Stable hash of what the agent sees (grid, start, goal); independent of seed/generator."""
        return self._digest(f"{self.size}|{self.start}|{self.goal}|")

    def is_floor(self, pos: tuple[int, int]) -> bool:
        r, c = pos
        return 0 <= r < self.size and 0 <= c < self.size and self.grid[r, c] == FLOOR

    def to_rows(self) -> list[str]:
        """Human-readable rows: '#' wall, '.' floor, 'S' start, 'G' goal (the frozen-set format)."""
        rows = [["#" if v else "." for v in row] for row in self.grid]
        rows[self.start[0]][self.start[1]] = "S"
        rows[self.goal[0]][self.goal[1]] = "G"
        return ["".join(r) for r in rows]

    @classmethod
    def from_rows(cls, rows: list[str], seed: int = -1, generator: str = "unknown",
                  braid: float = 0.0, placement: str = "corners") -> Maze:
        grid = np.array([[1 if ch == "#" else 0 for ch in row] for row in rows], dtype=np.uint8)
        start = goal = None
        for r, row in enumerate(rows):
            for c, ch in enumerate(row):
                if ch == "S":
                    start = (r, c)
                elif ch == "G":
                    goal = (r, c)
        if start is None or goal is None:
            raise ValueError("maze rows need one 'S' and one 'G'")
        return cls(grid, start, goal, seed, generator, braid, placement)

    def __eq__(self, other):
        return isinstance(other, Maze) and self.content_hash == other.content_hash

    def __hash__(self):
        return hash(self.content_hash)


def _check_size(size: int) -> None:
    if not (MIN_SIZE <= size <= MAX_SIZE) or size % 2 == 0:
        raise ValueError(f"maze size must be odd and in [{MIN_SIZE}, {MAX_SIZE}], got {size}")


def _room_edges(n: int) -> list[tuple[int, int]]:
    """Edges of the n x n room lattice as pairs of room indices (r * n + c)."""
    edges = []
    for r in range(n):
        for c in range(n):
            i = r * n + c
            if c + 1 < n:
                edges.append((i, i + 1))
            if r + 1 < n:
                edges.append((i, i + n))
    return edges


def _neighbours(i: int, n: int) -> list[int]:
    r, c = divmod(i, n)
    out = []
    if r > 0:
        out.append(i - n)
    if r + 1 < n:
        out.append(i + n)
    if c > 0:
        out.append(i - 1)
    if c + 1 < n:
        out.append(i + 1)
    return out


def _tree_wilson(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Uniform spanning tree by loop-erased random walks (Wilson 1996)."""
    total = n * n
    in_tree = np.zeros(total, dtype=bool)
    in_tree[int(rng.integers(total))] = True
    nxt = np.full(total, -1, dtype=np.int64)
    edges = []
    for start in rng.permutation(total):
        i = int(start)
        while not in_tree[i]:  # random walk, remembering the last exit from each cell
            nb = _neighbours(i, n)
            nxt[i] = nb[int(rng.integers(len(nb)))]
            i = int(nxt[i])
        i = int(start)
        while not in_tree[i]:  # follow the loop-erased path into the tree
            in_tree[i] = True
            edges.append((i, int(nxt[i])))
            i = int(nxt[i])
    return edges


def _tree_backtracker(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Recursive backtracker (randomised depth-first search), iterative."""
    seen = np.zeros(n * n, dtype=bool)
    first = int(rng.integers(n * n))
    stack, seen[first], edges = [first], True, []
    while stack:
        i = stack[-1]
        fresh = [j for j in _neighbours(i, n) if not seen[j]]
        if not fresh:
            stack.pop()
            continue
        j = fresh[int(rng.integers(len(fresh)))]
        seen[j] = True
        edges.append((i, j))
        stack.append(j)
    return edges


def _tree_prim(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Randomised Prim: grow from one room, adding a random frontier edge each time."""
    in_tree = np.zeros(n * n, dtype=bool)
    first = int(rng.integers(n * n))
    in_tree[first] = True
    frontier = [(first, j) for j in _neighbours(first, n)]
    edges = []
    while frontier:
        i, j = frontier.pop(int(rng.integers(len(frontier))))
        if in_tree[j]:
            continue
        in_tree[j] = True
        edges.append((i, j))
        frontier.extend((j, k) for k in _neighbours(j, n) if not in_tree[k])
    return edges


def _tree_kruskal(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Randomised Kruskal: shuffled lattice edges joined by union-find."""
    parent = list(range(n * n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    all_edges = _room_edges(n)
    edges = []
    for k in rng.permutation(len(all_edges)):
        a, b = all_edges[int(k)]
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
            edges.append((a, b))
    return edges


def _tree_sidewinder(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Sidewinder: the top row is one corridor; each later row is cut into runs, each run carved east and joined
    to the row above at one random room. Strongly biased (long horizontal corridors, a clear route up from every
    run): the held-out generator, one that no shipped training mixture uses."""
    edges = []
    for c in range(n - 1):
        edges.append((c, c + 1))
    for r in range(1, n):
        run = []
        for c in range(n):
            i = r * n + c
            run.append(i)
            if c + 1 < n and rng.random() < 0.5:
                edges.append((i, i + 1))
                continue
            j = run[int(rng.integers(len(run)))]
            edges.append((j, j - n))
            run = []
    return edges


_TREES = {"wilson": _tree_wilson, "backtracker": _tree_backtracker,
          "prim": _tree_prim, "kruskal": _tree_kruskal, "sidewinder": _tree_sidewinder}


def _carve(size: int, n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    grid = np.ones((size, size), dtype=np.uint8)
    grid[1::2, 1::2] = FLOOR  # rooms
    for a, b in edges:
        (ra, ca), (rb, cb) = divmod(a, n), divmod(b, n)
        grid[ra + rb + 1, ca + cb + 1] = FLOOR  # the wall cell between two rooms
    return grid


def _braid(grid: np.ndarray, fraction: float, rng: np.random.Generator) -> None:
    """Open a wall at ``fraction`` of the dead-end rooms (in place), creating loops."""
    size = grid.shape[0]
    rooms = [(r, c) for r in range(1, size, 2) for c in range(1, size, 2)]
    order = rng.permutation(len(rooms))
    dead_ends = [rooms[int(k)] for k in order
                 if sum(grid[rooms[int(k)][0] + dr, rooms[int(k)][1] + dc] == FLOOR
                        for dr, dc in MOVES.values()) == 1]
    for r, c in dead_ends[: int(round(fraction * len(dead_ends)))]:
        if sum(grid[r + dr, c + dc] == FLOOR for dr, dc in MOVES.values()) != 1:
            continue  # an earlier opening already fixed this one
        closed = [(dr, dc) for dr, dc in MOVES.values()
                  if grid[r + dr, c + dc] == WALL and 0 < r + 2 * dr < size and 0 < c + 2 * dc < size]
        if closed:
            dr, dc = closed[int(rng.integers(len(closed)))]
            grid[r + dr, c + dc] = FLOOR


def corner(size: int, name: str) -> tuple[int, int]:
    """The room in corner ``name`` (top_left, top_right, bottom_left, bottom_right) of a ``size`` maze."""
    far = size - 2
    return {"top_left": (1, 1), "top_right": (1, far), "bottom_left": (far, 1), "bottom_right": (far, far)}[name]


def generate_maze(size: int = 9, seed: int = 0, generator: str = "wilson", braid: float = 0.0,
                  placement: str = "corners", min_distance: int | None = None) -> Maze:
    """Generate a maze deterministically from ``seed``.

    placement: ``corners`` puts the start top-left and the goal bottom-right; ``corners4`` draws one of
    the reference's four corner pairs (``CORNER_PAIRS``) after the maze, as the reference does; ``random``
    picks two rooms at BFS distance >= ``min_distance`` (default: the size).
    """
    _check_size(size)
    if generator not in _TREES:
        raise ValueError(f"unknown maze generator {generator!r}; choose from {GENERATORS}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
    if not 0.0 <= braid <= 1.0:
        raise ValueError(f"braid must be in [0, 1], got {braid}")
    rng = np.random.default_rng([int(seed), size, GENERATORS.index(generator)])
    n = (size - 1) // 2
    grid = _carve(size, n, _TREES[generator](n, rng))
    if braid > 0:
        _braid(grid, braid, rng)
    if placement == "corners":
        start, goal = (1, 1), (size - 2, size - 2)
    elif placement == "corners4":
        first, second = CORNER_PAIRS[int(rng.integers(len(CORNER_PAIRS)))]
        start, goal = corner(size, first), corner(size, second)
    else:

        want = size if min_distance is None else int(min_distance)
        rooms = [(r, c) for r in range(1, size, 2) for c in range(1, size, 2)]
        for _ in range(1000):
            start = rooms[int(rng.integers(len(rooms)))]
            dist = distances_from(grid, start)
            far = [p for p in rooms if dist[p] >= want]
            if far:
                goal = far[int(rng.integers(len(far)))]
                break
        else:
            raise ValueError(f"no start/goal pair at distance >= {want} in a {size}x{size} maze")
    return Maze(grid, start, goal, int(seed), generator, float(braid), placement)


# ---------------------------------------------------------------- breadth-first search
UNREACHABLE = -1


def distances_from(grid: np.ndarray, source: tuple[int, int]) -> np.ndarray:
    """BFS distance (in moves) from ``source`` to every cell; -1 for walls and unreachable cells.

    grid: (N, N) uint8, 1 = wall. Returns (N, N) int32.
    """
    size = grid.shape[0]
    dist = np.full(grid.shape, UNREACHABLE, dtype=np.int32)
    if grid[source] != FLOOR:
        return dist
    dist[source] = 0
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        d = dist[r, c] + 1
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and grid[nr, nc] == FLOOR and dist[nr, nc] < 0:
                dist[nr, nc] = d
                queue.append((nr, nc))
    return dist


def dead_ends(maze: Maze, position: tuple[int, int], depth: int) -> list[str]:
    """The moves out of ``position`` that enter a pocket: a region, reachable only through that neighbour, that
    does not hold the goal and reaches at most ``depth`` cells away from ``position``. What a lookahead of
    ``depth`` cells sees: on a perfect maze, avoiding these and heading for the goal solves 0.95 of ``fixed64``
    within 20 turns at ``depth`` 8 (0.41 with no lookahead; ``rl.policies`` lookahead8 and greedy)."""
    blocked = maze.grid.copy()
    blocked[position] = WALL  # the region behind a neighbour, without passing through the agent's cell
    out = []
    for name, (dr, dc) in MOVES.items():
        n = (position[0] + dr, position[1] + dc)
        if not maze.is_floor(n):
            continue
        dist = distances_from(blocked, n)
        if dist[maze.goal] == UNREACHABLE and int(dist.max()) + 1 <= depth:
            out.append(name)
    return out


def shortest_path(maze: Maze, start: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Cells from ``start`` (default: the maze start) to the goal, both included; [] if none."""
    start = maze.start if start is None else start
    to_goal = distances_from(maze.grid, maze.goal)
    if to_goal[start] < 0:
        return []
    path = [start]
    while path[-1] != maze.goal:
        r, c = path[-1]
        for dr, dc in MOVES.values():  # fixed order: ties break the same way every time
            nxt = (r + dr, c + dc)
            if maze.is_floor(nxt) and to_goal[nxt] == to_goal[r, c] - 1:
                path.append(nxt)
                break
    return path


def optimal_steps(maze: Maze, start: tuple[int, int] | None = None) -> int:
    """Fewest moves from ``start`` (default: the maze start) to the goal; -1 if unreachable."""
    start = maze.start if start is None else start
    return int(distances_from(maze.grid, maze.goal)[start])


def path_to_actions(path: list[tuple[int, int]]) -> list[str]:
    """Move names ('up', 'down', 'left', 'right') that walk ``path``."""
    by_delta = {v: k for k, v in MOVES.items()}
    return [by_delta[(b[0] - a[0], b[1] - a[1])] for a, b in zip(path, path[1:])]


def expert_actions(maze: Maze, start: tuple[int, int] | None = None) -> list[str]:
    """The BFS expert's moves from ``start`` to the goal (without the final 'stop')."""
    return path_to_actions(shortest_path(maze, start))


# ---------------------------------------------------------------- frozen evaluation suites and the training stream
DATA_FILE = Path(__file__).parent / "data" / "eval_sets.json"
# The reference's 64 evaluation mazes (data produced by running the reference environment), read by --freeze.
REFERENCE_FILE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "maze2d_easy_seeds0-63.json"

# name -> (description, generate_maze kwargs, number of mazes)
SUITE_SPECS: dict[str, tuple[str, dict, int]] = {
    "fixed64": ("the reference's 64 evaluation mazes: maze_2d/easy 9x9, reset(seed=i) for i = 0..63, "
                "four corner pairs", dict(size=9, generator="wilson", placement="corners4"), 64),
    "select64": ("recipe selection: 64 more 9x9 Wilson mazes, four corner pairs (choose recipes here, "
                 "report on fixed64)", dict(size=9, generator="wilson", placement="corners4"), 64),
    "size7": ("smaller than trained: 7x7 Wilson, four corner pairs",
              dict(size=7, generator="wilson", placement="corners4"), 32),
    "size11": ("maze_hard: 11x11 Wilson, four corner pairs",
               dict(size=11, generator="wilson", placement="corners4"), 32),
    "size13": ("larger than trained: 13x13 Wilson, four corner pairs",
               dict(size=13, generator="wilson", placement="corners4"), 32),
    "size15": ("larger than trained: 15x15 Wilson, four corner pairs",
               dict(size=15, generator="wilson", placement="corners4"), 32),
    "gen_backtracker": ("9x9 recursive backtracker (long corridors), four corner pairs",
                        dict(size=9, generator="backtracker", placement="corners4"), 32),
    "gen_prim": ("9x9 randomised Prim (many short dead ends), four corner pairs",
                 dict(size=9, generator="prim", placement="corners4"), 32),
    "gen_kruskal": ("9x9 randomised Kruskal, four corner pairs",
                    dict(size=9, generator="kruskal", placement="corners4"), 32),
    "braided": ("9x9 Wilson with half the dead ends opened (loops possible), four corner pairs",
                dict(size=9, generator="wilson", braid=0.5, placement="corners4"), 32),
    "random_placement": ("9x9 Wilson, start and goal random rooms at BFS distance >= 9",
                         dict(size=9, generator="wilson", placement="random", min_distance=9), 32),
    # unseen kinds: what no training mixture of the shipped recipes draws (appended, so the suites above keep
    # their mazes)
    "size17": ("larger than any trained size: 17x17 Wilson, four corner pairs",
               dict(size=17, generator="wilson", placement="corners4"), 32),
    "gen_sidewinder": ("9x9 sidewinder (a generator no shipped mixture trains on), four corner pairs",
                       dict(size=9, generator="sidewinder", placement="corners4"), 32),
    "braided11": ("11x11 Wilson with half the dead ends opened (several routes), four corner pairs",
                  dict(size=11, generator="wilson", braid=0.5, placement="corners4"), 32),
    "braided13": ("13x13 Wilson with half the dead ends opened (several routes), four corner pairs",
                  dict(size=13, generator="wilson", braid=0.5, placement="corners4"), 32),
    # recipe selection at other sizes (choose training mixtures and curricula here, report on the suites above)
    "select7": ("recipe selection: 32 more 7x7 Wilson mazes, four corner pairs",
                dict(size=7, generator="wilson", placement="corners4"), 32),
    "select11": ("recipe selection: 32 more 11x11 Wilson mazes, four corner pairs",
                 dict(size=11, generator="wilson", placement="corners4"), 32),
}


def reference_mazes(path: Path = REFERENCE_FILE) -> list[Maze]:
    """The reference's 64 evaluation mazes, in seed order, from its data file (grid, start, goal)."""
    if not path.is_file():
        raise FileNotFoundError(f"the reference's maze file is not at {path}; freezing fixed64 needs it")
    raw = json.loads(path.read_text())
    mazes = []
    for rec in sorted(raw["mazes"], key=lambda r: r["seed"]):
        grid = np.array(rec["grid"], dtype=np.uint8)
        mazes.append(Maze(grid, tuple(rec["start"]), tuple(rec["goal"]), int(rec["seed"]), "wilson",
                          0.0, "corners4"))
    if [m.seed for m in mazes] != list(range(64)):
        raise ValueError(f"{path} must hold the reference's seeds 0-63")
    return mazes


@dataclass(frozen=True)
class EvalSuite:
    name: str
    description: str
    mazes: tuple[Maze, ...]

    def __len__(self) -> int:
        return len(self.mazes)


def _build_suites(reference: Path = REFERENCE_FILE) -> dict[str, list[Maze]]:
    seen: set[str] = set()  # layout hashes: no two suites share a grid
    suites = {"fixed64": reference_mazes(reference)}
    seen.update(m.layout_hash for m in suites["fixed64"])
    for name, (_, kwargs, count) in SUITE_SPECS.items():
        if name == "fixed64":
            continue
        mazes, seed = [], 0  # every suite starts at seed 0; layouts already in a suite are skipped
        while len(mazes) < count:
            maze = generate_maze(seed=seed, **kwargs)
            seed += 1
            if maze.layout_hash in seen:
                continue
            seen.add(maze.layout_hash)
            mazes.append(maze)
        suites[name] = mazes
    return suites


def freeze(path: Path = DATA_FILE, reference: Path = REFERENCE_FILE) -> None:
    """Write every suite to ``path`` (text grids + hashes)."""
    out = {"version": 2, "suites": {}}
    for name, mazes in _build_suites(reference).items():
        out["suites"][name] = {
            "description": SUITE_SPECS[name][0],
            "mazes": [{"rows": m.to_rows(), "seed": m.seed, "generator": m.generator,
                       "braid": m.braid, "placement": m.placement, "hash": m.content_hash}
                      for m in mazes],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


@cache
def _load_file(path: str) -> dict[str, EvalSuite]:
    raw = json.loads(Path(path).read_text())
    suites = {}
    for name, entry in raw["suites"].items():
        mazes = []
        for rec in entry["mazes"]:
            maze = Maze.from_rows(rec["rows"], rec["seed"], rec["generator"], rec["braid"],
                                  rec["placement"])
            if maze.content_hash != rec["hash"]:
                raise ValueError(f"eval suite {name!r} in {path} is corrupt: maze seed {rec['seed']} "
                                 f"hashes to {maze.content_hash}, file says {rec['hash']}")
            mazes.append(maze)
        suites[name] = EvalSuite(name, entry["description"], tuple(mazes))
    return suites


def suite_names() -> list[str]:
    return list(_load_file(str(DATA_FILE)))


def load_suite(name: str) -> EvalSuite:
    suites = _load_file(str(DATA_FILE))
    if name not in suites:
        raise KeyError(f"unknown eval suite {name!r}; available: {', '.join(suites)}")
    return suites[name]


def eval_hashes() -> frozenset[str]:
    """Content hashes of every maze in every frozen suite."""
    return frozenset(m.content_hash for s in _load_file(str(DATA_FILE)).values() for m in s.mazes)


def eval_layouts() -> frozenset[str]:
    """Layout (grid) hashes of every maze in every frozen suite: what training must never draw."""
    return frozenset(m.layout_hash for s in _load_file(str(DATA_FILE)).values() for m in s.mazes)


@dataclass(frozen=True)
class MixItem:
    """One kind of training maze in a mixture (``env.train_mix``): drawn with probability ``weight`` / total."""

    size: int = 9
    generator: str = "wilson"
    braid: float = 0.0
    placement: str = "corners4"
    weight: float = 1.0


CURRICULA = ("none", "size", "reverse", "replay")


class TrainSampler:
    """Deterministic stream of training mazes that skips every layout found in an eval suite.

    The distribution is either the product ``sizes`` x ``generators`` (each drawn uniformly per maze) with one
    ``braid`` and ``placement``, or a weighted mixture ``mix`` of ``MixItem`` kinds. A ``curriculum`` reshapes it
    over training (``set_progress(f)``, f in [0, 1], set from the step, so a resumed run draws the same):

    - ``size``: only the kinds of size <= a limit growing linearly from the smallest to the largest size by
      f = 1 (the mix's weights renormalised over the kinds allowed);
    - ``reverse``: the start moves onto the shortest path, ``f`` of its length away from the goal (at least two
      cells), so early episodes start near the goal and later ones from the real start;
    - ``replay``: a share ``replay_fraction`` of each draw replays mazes the policy failed, sampled with weight
      (1 - their last group success rate) from a buffer of ``replay_capacity`` (``record`` fills it).

    Its state is ``position`` (candidates drawn) plus the replay buffer, so a checkpoint that saves
    ``state_dict()`` resumes the exact stream.
    """

    SEED_OFFSET = 1_000_000_000  # training seeds live far from the eval seeds (0..~100)

    def __init__(self, sizes=(9,), generators=("wilson",), braid: float = 0.0,
                 placement: str = "corners4", seed: int = 0, exclude: frozenset[str] | None = None,
                 max_skips: int = 10_000, mix: list[MixItem] | None = None, curriculum: str = "none",
                 replay_fraction: float = 0.5, replay_capacity: int = 256):
        for g in [*generators, *(m.generator for m in mix or [])]:
            if g not in GENERATORS:
                raise ValueError(f"unknown maze generator {g!r}; choose from {GENERATORS}")
        if curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {curriculum!r}; choose from {CURRICULA}")
        self.sizes, self.generators = [int(s) for s in sizes], list(generators)
        self.braid, self.placement, self.seed = float(braid), placement, int(seed)
        self.mix = list(mix or [])
        self.curriculum, self.progress = curriculum, 1.0 if curriculum == "none" else 0.0
        self.replay_fraction, self.replay_capacity = float(replay_fraction), int(replay_capacity)
        self.replay: list[tuple[Maze, float]] = []  # (maze, its last group success rate), oldest first
        self.exclude = eval_layouts() if exclude is None else exclude  # layout hashes
        self.max_skips, self.position, self.skipped = max_skips, 0, 0

    @classmethod
    def from_config(cls, env, seed: int) -> TrainSampler:
        """The sampler an ``env.*`` config describes (``conf/schema.EnvConfig``: train_sizes, generators, braid,
        placement or train_mix, and the curriculum keys)."""
        mix = [MixItem(int(m.size), str(m.generator), float(m.braid), str(m.placement), float(m.weight))
               for m in env.train_mix]
        return cls(sizes=list(env.train_sizes) or [env.size], generators=list(env.generators), braid=env.braid,
                   placement=env.placement, seed=seed, mix=mix, curriculum=env.curriculum,
                   replay_fraction=env.replay_fraction, replay_capacity=env.replay_capacity)

    def set_progress(self, fraction: float) -> None:
        self.progress = min(max(float(fraction), 0.0), 1.0)

    def allowed(self) -> list[MixItem]:
        """The mix's kinds the curriculum allows now (all of them unless ``size``)."""
        if self.curriculum != "size":
            return self.mix
        sizes = sorted({m.size for m in self.mix})
        limit = sizes[0] + self.progress * (sizes[-1] - sizes[0])
        return [m for m in self.mix if m.size <= limit + 1e-9]

    def _candidate(self, index: int) -> Maze:
        rng = np.random.default_rng([self.seed, index, 7])
        maze_seed = self.SEED_OFFSET + self.seed * 10_000_000 + index
        if self.mix:
            kinds = self.allowed()
            weights = np.array([m.weight for m in kinds], dtype=np.float64)
            k = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
            return generate_maze(k.size, maze_seed, k.generator, k.braid, k.placement)
        size = self.sizes[int(rng.integers(len(self.sizes)))]
        generator = self.generators[int(rng.integers(len(self.generators)))]
        return generate_maze(size, maze_seed, generator, self.braid, self.placement)

    def _reverse(self, maze: Maze) -> Maze:
        path = shortest_path(maze)  # start ... goal
        back = max(2, int(round(self.progress * (len(path) - 1))))
        if back >= len(path) - 1:
            return maze
        return Maze(maze.grid, path[len(path) - 1 - back], maze.goal, maze.seed, maze.generator, maze.braid,
                    "reverse")

    def __iter__(self):
        return self

    def __next__(self) -> Maze:
        for _ in range(self.max_skips):
            maze = self._candidate(self.position)
            self.position += 1
            if maze.layout_hash not in self.exclude:
                return self._reverse(maze) if self.curriculum == "reverse" else maze
            self.skipped += 1
        raise RuntimeError(f"train sampler skipped {self.max_skips} mazes in a row whose layouts are all in "
                           f"eval suites; sizes {self.sizes} have too few distinct layouts")

    def take(self, count: int) -> list[Maze]:
        """``count`` mazes; with ``replay``, the first ``replay_fraction`` of them drawn from the failure buffer."""
        replayed = []
        if self.curriculum == "replay" and self.replay:
            weights = np.array([1.0 - s for _, s in self.replay]) + 1e-3
            rng = np.random.default_rng([self.seed, self.position, 11])
            n = min(int(round(self.replay_fraction * count)), len(self.replay))
            picks = rng.choice(len(self.replay), size=n, replace=False, p=weights / weights.sum())
            replayed = [self.replay[int(i)][0] for i in picks]
        return replayed + [next(self) for _ in range(count - len(replayed))]

    def record(self, mazes: list[Maze], success: list[float]) -> dict[str, float]:
        """``replay``: remember each maze's group success rate (a replayed maze's entry is refreshed); the buffer
        keeps the newest ``replay_capacity``. Returns what to log."""
        if self.curriculum != "replay":
            return {}
        for maze, rate in zip(mazes, success):
            self.replay = [(m, s) for m, s in self.replay if m.content_hash != maze.content_hash]
            self.replay.append((maze, float(rate)))
        self.replay = self.replay[-self.replay_capacity:]
        fails = [1.0 - s for _, s in self.replay]
        return {"replay/buffer": float(len(self.replay)), "replay/buffer_failure_rate": float(np.mean(fails)),
                "replay/unsolved_share": float(np.mean([f == 1.0 for f in fails]))}

    def state_dict(self) -> dict:
        return {"position": self.position, "skipped": self.skipped, "seed": self.seed,
                "replay": [{"rows": m.to_rows(), "seed": m.seed, "generator": m.generator, "braid": m.braid,
                            "placement": m.placement, "success": s} for m, s in self.replay]}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for seed {state['seed']}, this sampler has {self.seed}")
        self.position, self.skipped = int(state["position"]), int(state["skipped"])
        self.replay = [(Maze.from_rows(r["rows"], r["seed"], r["generator"], r["braid"], r["placement"]),
                        float(r["success"])) for r in state.get("replay", [])]


def main() -> None:
    parser = argparse.ArgumentParser(description="List or rewrite the frozen evaluation suites.")
    parser.add_argument("--freeze", action="store_true", help=f"rewrite {DATA_FILE}")
    parser.add_argument("--reference", type=Path, default=REFERENCE_FILE,
                        help="the reference's maze file that fixed64 is frozen from")
    parser.add_argument("--list", action="store_true", help="list the frozen suites")
    args = parser.parse_args()
    if args.freeze:
        freeze(reference=args.reference)
        print(f"wrote {DATA_FILE}")
    for name in suite_names():
        suite = load_suite(name)
        print(f"{name:18s} {len(suite):3d} mazes  {suite.description}")


if __name__ == "__main__":
    main()
