"""Breadth-first search: distances, the shortest path, the optimal step count, expert actions."""

from __future__ import annotations

from collections import deque

import numpy as np

from maze.core import FLOOR, MOVES, Maze

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
