"""Failure analysis of one episode's path: loops, dead-end entries and backtracks, failure class.

Definitions (all on the sequence of cells the agent occupied, consecutive repeats from wall bumps
and invalid actions collapsed):

- *loop*: the agent returns to a cell and then repeats the exact cell sequence it walked since its
  previous visit there (going round a cycle a second time, or oscillating A-B-A-B). Each repeat is
  counted once.
- *dead-end entry*: a step from a cell on the maze's shortest start-goal path into a cell off it
  (into a side branch; in a perfect maze every such branch is a dead end). A *backtrack* is the
  later step back onto the path from that branch; an episode that ends inside a branch ends
  *in_dead_end*.
- *junction decision*: a move out of a cell with three or more open neighbours, made the first time the agent
  stands there; it is *right* when it lowers the BFS distance to the goal. A policy that reads the maze makes
  them right; one that guesses is right about as often as chance (one of two or three ways). Corridor moves
  are not counted (their direction follows from the last junction).
- per training step (``rollout_counts``, ``rollout_scalars``): bumps and revisits per episode, invalid actions,
  moves into a way the turn's own thought called a pocket, and (``reward.thought_pockets``) thoughts that named the
  pockets right, per turn.
- failure class (one per failed episode, first match wins): stopped_wrong_cell, context_limit,
  then for time-outs: looping, stuck_in_dead_end, invalid_actions (over half the turns invalid),
  wall_bumping (over half the turns bumps), timed_out.
"""

from __future__ import annotations

from maze.core import MOVES, Maze, distances_from, shortest_path
from maze.rewards import thought_reward
from maze.thought import against_thought


def collapse(path: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop consecutive duplicates (turns where the agent did not move)."""
    out = []
    for p in path:
        if not out or out[-1] != p:
            out.append(tuple(p))
    return out


def count_loops(path: list[tuple[int, int]]) -> int:
    """Number of repeated cycles in the (collapsed) path; see the module docstring."""
    cells = collapse(path)
    last_seen: dict[tuple[int, int], int] = {}
    loops, skip_until = 0, -1
    for j, cell in enumerate(cells):
        i = last_seen.get(cell)
        if i is not None and j >= skip_until:
            length = j - i
            if length >= 2 and cells[j:j + length] == cells[i:j]:
                loops += 1
                skip_until = j + length  # count each repeat once
        last_seen[cell] = j
    return loops


def dead_end_stats(maze: Maze, path: list[tuple[int, int]]) -> dict:
    """Dead-end entries, backtracks out of them, and whether the episode ended inside one."""
    on_path = set(shortest_path(maze))
    cells = collapse(path)
    entries = backtracks = 0
    for a, b in zip(cells, cells[1:]):
        if a in on_path and b not in on_path:
            entries += 1
        elif a not in on_path and b in on_path:
            backtracks += 1
    return {"dead_end_entries": entries, "dead_end_backtracks": backtracks,
            "ended_in_dead_end": bool(cells) and cells[-1] not in on_path}


def junction_stats(maze: Maze, path: list[tuple[int, int]]) -> dict:
    """Junction decisions of the (collapsed) path, and how many went towards the goal (module docstring)."""
    to_goal = distances_from(maze.grid, maze.goal)
    cells, seen = collapse(path), set()
    decisions = right = 0
    for a, b in zip(cells, cells[1:]):
        first = a not in seen
        seen.add(a)
        if first and sum(maze.is_floor((a[0] + dr, a[1] + dc)) for dr, dc in MOVES.values()) >= 3:
            decisions += 1
            right += int(to_goal[b] < to_goal[a])
    return {"junction_decisions": decisions, "junction_right": right}


def failure_class(success: bool, finish: str, turns: int, loops: int, ended_in_dead_end: bool,
                  invalid_actions: int, bumps: int) -> str:
    if success:
        return "success"
    if finish == "stop_wrong":
        return "stopped_wrong_cell"
    if finish == "context":
        return "context_limit"
    if loops > 0:
        return "looping"
    if ended_in_dead_end:
        return "stuck_in_dead_end"
    if turns and invalid_actions > turns / 2:
        return "invalid_actions"
    if turns and bumps > turns / 2:
        return "wall_bumping"
    return "timed_out"


def rollout_counts(episodes, reward_cfg) -> dict[str, float]:
    """This rank's sums over a training step's episodes (``rl.rollout.Trajectory``) of what the maze logs."""
    return {
        "bumps": float(sum(t.final_info.get("bumps", 0) for t in episodes)),
        "revisits": float(sum(t.final_info.get("revisits", 0) for t in episodes)),
        "invalid": float(sum(t.final_info.get("invalid_actions", 0) for t in episodes)),
        # reward.thought_pockets: turns whose thought named the pockets right (0 when the reward is off)
        "thought_right": float(sum(r > 0 for t in episodes for r in thought_reward(t, reward_cfg))),
        # pocket thoughts (algo.sft_lookahead starts): moves into a way the turn's own thought called a pocket
        "against_thought": float(sum(against_thought(text) for t in episodes for text in t.actions)),
    }


def rollout_scalars(tot: dict[str, float], reward_cfg) -> dict[str, float]:
    """TensorBoard's ``rollout/`` maze scalars from ``rollout_counts`` summed over ranks, with ``n`` episodes and
    ``turns`` turns."""
    turns = max(tot["turns"], 1.0)
    out = {"rollout/bumps_mean": tot["bumps"] / tot["n"], "rollout/revisits_mean": tot["revisits"] / tot["n"],
           "rollout/invalid_rate": tot["invalid"] / turns,
           "rollout/moves_against_thought": tot["against_thought"] / turns}
    if reward_cfg.thought_pockets:
        out["rollout/thought_pockets_right"] = tot["thought_right"] / turns
    return out
