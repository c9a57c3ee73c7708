"""Episode rewards from the environment's ``info`` (conf/reward). Success is logged separately.

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
