"""Reference policies played through the same environment, trajectories and metrics as the model.

- ``oracle``: the BFS expert from wherever it stands; must score 100 % with step ratio 1.0.
- ``random``: a uniformly random move each turn, ``stop`` only when on the goal (a random walker
  that recognises the goal, so its success rate is the chance of hitting the goal in time).
- ``wall_follower``: the right-hand rule, a classic hand-written baseline; it solves every perfect
  maze given enough turns, and can circle forever around an island in a braided one.
- ``greedy``: depth-first search that enters the unvisited neighbour nearest the goal (Manhattan) and backs up
  out of dead ends: navigation with memory but no planning (0.41 of ``fixed64`` in 20 turns).
- ``lookahead8``: ``greedy`` that also never enters a dead-end pocket at most 8 cells deep (``maze.core.dead_ends``,
  what the SFT thought names with ``algo.sft_lookahead=8``): how far that local feature goes (0.95 of ``fixed64``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from maze.core import MOVES, Maze, dead_ends, expert_actions, shortest_path
from maze.env import EnvSettings, MazeEnv, format_action
from rl.rollout import Trajectory, finish_reason

POLICIES = ("oracle", "random", "wall_follower", "greedy", "lookahead8")
START_HEADING = "down"  # the wall follower's heading before its first move
_RIGHT_OF = {"up": "right", "right": "down", "down": "left", "left": "up"}
_LEFT_OF = {v: k for k, v in _RIGHT_OF.items()}
_BACK = {"up": "down", "down": "up", "left": "right", "right": "left"}


def _oracle(env: MazeEnv, state: dict, rng) -> str:
    if env.position == env.maze.goal:
        return "stop"
    return expert_actions(env.maze, env.position)[0]


def _random(env: MazeEnv, state: dict, rng) -> str:
    if env.position == env.maze.goal:
        return "stop"
    return list(MOVES)[int(rng.integers(4))]


def _wall_follower(env: MazeEnv, state: dict, rng) -> str:
    if env.position == env.maze.goal:
        return "stop"
    heading = state.setdefault("heading", START_HEADING)  # the direction of the last move that moved the agent
    r, c = env.position
    for move in (_RIGHT_OF[heading], heading, _LEFT_OF[heading], _BACK[heading]):
        dr, dc = MOVES[move]
        if env.maze.is_floor((r + dr, c + dc)):
            state["heading"] = move
            return move
    return "stop"  # boxed in (cannot happen in a connected maze)


def _dfs(lookahead: int):
    def act(env: MazeEnv, state: dict, rng) -> str:
        pos, goal = env.position, env.maze.goal
        if pos == goal:
            return "stop"
        visited, stack = state.setdefault("visited", {pos}), state.setdefault("stack", [pos])
        if stack[-1] != pos:  # moved by someone else (SFT noise turns): walk the search there, cell by cell
            for cell in shortest_path(replace(env.maze, goal=pos), stack[-1])[1:]:
                if cell in stack:
                    del stack[stack.index(cell) + 1:]
                else:
                    visited.add(cell)
                    stack.append(cell)
        skip = set(dead_ends(env.maze, pos, lookahead)) if lookahead else set()
        options = []
        for move, (dr, dc) in MOVES.items():
            n = (pos[0] + dr, pos[1] + dc)
            if env.maze.is_floor(n) and n not in visited and move not in skip:
                options.append((abs(n[0] - goal[0]) + abs(n[1] - goal[1]), list(MOVES).index(move), move, n))
        if options:
            *_, move, n = min(options)
            visited.add(n)
            stack.append(n)
            return move
        if len(stack) < 2:  # searched out without the goal: only after noise turns marked cells it never explored
            state["visited"], state["stack"] = {pos}, [pos]
            return act(env, state, rng)
        stack.pop()
        back = stack[-1]
        return next(m for m, (dr, dc) in MOVES.items() if (pos[0] + dr, pos[1] + dc) == back)
    return act


ACT = {"oracle": _oracle, "random": _random, "wall_follower": _wall_follower, "greedy": _dfs(0),
       "lookahead8": _dfs(8)}


def play(policy: str, mazes: list[Maze], env: EnvSettings, seed: int = 0, samples: int = 1) -> list[Trajectory]:
    """Play ``samples`` episodes of ``policy`` on each maze; group-major like ``rl.rollout.rollout``."""
    if policy not in ACT:
        raise ValueError(f"unknown policy {policy!r}; choose from model, {', '.join(POLICIES)}")
    rng = np.random.default_rng(seed)
    trajs = []
    for g, maze in enumerate(mazes):
        for _ in range(samples):
            e = MazeEnv(replace(env, pixels_per_cell=4, max_moves_per_turn=1))  # small frames: nothing reads them
            e.reset(options={"maze": maze})
            t, state = Trajectory(maze=maze, group=g), {}
            while True:
                text = format_action(ACT[policy](e, state, rng), env.interface)
                _, _, terminated, truncated, info = e.step(text)
                t.actions.append(text)
                t.infos.append(info)
                if terminated or truncated:
                    t.finish = finish_reason(info)
                    break
            trajs.append(t)
    return trajs
