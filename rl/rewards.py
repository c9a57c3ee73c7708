"""Episode and per-turn rewards from the environment's ``info`` (conf/reward). Success is logged separately.

sparse: ``success`` on success, else 0.
shaped: sparse + ``progress`` * (d_start - d_end) / d_start  (BFS distance to the goal)
        - ``step_cost`` * turns - ``bump_penalty`` * bumps - ``invalid_penalty`` * invalid actions
        - ``revisit_penalty`` * revisits.
"""

from __future__ import annotations

from rl.types import Trajectory


def episode_reward(traj: Trajectory, cfg) -> float:
    info = traj.final_info
    reward = cfg.success if info.get("success") else 0.0
    if cfg.name == "sparse":
        return float(reward)
    start = max(info["optimal_steps"], 1)
    reward += cfg.progress * (start - info["distance_to_goal"]) / start
    reward -= cfg.step_cost * info["turns"]
    reward -= cfg.bump_penalty * info["bumps"]
    reward -= cfg.invalid_penalty * info["invalid_actions"]
    reward -= cfg.revisit_penalty * info["revisits"]
    return float(reward)


def turn_rewards(traj: Trajectory, cfg) -> list[float]:
    """The episode reward split over its turns (they sum to ``episode_reward``): the BFS progress of each turn,
    its step cost, the bumps, invalid actions and revisits it added, and the success bonus on the last turn."""
    out, prev = [], {"distance_to_goal": None, "bumps": 0, "invalid_actions": 0, "revisits": 0}
    for k, info in enumerate(traj.infos):
        last = k == len(traj.infos) - 1
        r = cfg.success if last and info.get("success") else 0.0
        if cfg.name != "sparse":
            start = max(info["optimal_steps"], 1)
            before = info["optimal_steps"] if prev["distance_to_goal"] is None else prev["distance_to_goal"]
            r += cfg.progress * (before - info["distance_to_goal"]) / start
            r -= cfg.step_cost
            r -= cfg.bump_penalty * (info["bumps"] - prev["bumps"])
            r -= cfg.invalid_penalty * (info["invalid_actions"] - prev["invalid_actions"])
            r -= cfg.revisit_penalty * (info["revisits"] - prev["revisits"])
        prev = info
        out.append(float(r))
    return out
