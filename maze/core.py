"""Mazes as data: the grid, perfect-maze generators, start/goal placement, BFS and the dead-end pockets it finds.
The frozen evaluation suites are ``maze/suites.py``; the training stream that never draws their layouts is
``maze/sampler.py``.

A maze is a *block* maze, as in the reference environment: walls are whole cells. A maze of
odd size N (5..31) holds an outer wall ring; the "rooms" sit at odd coordinates (r, c) and
the cells between two rooms are either wall or corridor. ``grid[r, c] == 1`` is a wall.

Generators carve a spanning tree over the (N-1)/2 x (N-1)/2 room lattice, so the floor is a
tree (a *perfect* maze: exactly one route between any two cells) unless ``braid > 0`` opens
extra walls at dead ends. Everything is a pure function of an integer seed.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

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
