"""The maze's rewards (``conf/reward``), computed from an episode's record and handed to GRPO as numbers
(``rl.grpo.build_batch`` knows nothing of mazes). Success is logged separately.

sparse: ``success`` on success, else 0.
shaped: sparse + ``progress`` * (d_start - d_end) / d_start  (BFS distance to the goal)
        - ``step_cost`` * turns - ``bump_penalty`` * bumps - ``invalid_penalty`` * invalid actions
        - ``revisit_penalty`` * revisits - ``wrong_stop_penalty`` if it stopped away from the goal.
Either, with ``thought_pockets`` > 0: + ``thought_pockets`` for each turn whose thought names exactly the dead-end
pockets next to the agent (``thought_reward``).

An episode is anything with ``maze``, ``actions`` (each turn's text), ``infos`` (each turn's environment info,
``maze.env.MazeEnv.step``) and ``final_info`` (the last of them): ``rl.rollout.Trajectory``.
"""

from __future__ import annotations

from maze.thought import named_pockets, pockets


def thought_reward(episode, cfg) -> list[float]:
    """Per turn, ``cfg.thought_pockets`` if the turn's thought named exactly the ways out of the agent's cell that
    enter a dead-end pocket at most ``cfg.thought_lookahead`` cells deep (``maze.core.dead_ends``; the
    ``algo.sft_lookahead`` thought, ``<think>open up down left; not down</think>``), else 0. A turn on the goal has
    no pockets to name. The truth is the environment's, so the reward cannot be met by anything but reading."""
    if not cfg.thought_pockets:
        return [0.0] * len(episode.infos)
    out, pos = [], episode.maze.start
    for text, info in zip(episode.actions, episode.infos):
        right = named_pockets(text) == pockets(episode.maze, pos, cfg.thought_lookahead)
        out.append(float(cfg.thought_pockets) if right else 0.0)
        pos = tuple(info["position"])
    return out


def episode_reward(episode, cfg) -> float:
    """The episode's reward (the module docstring's sum)."""
    info = episode.final_info
    reward = cfg.success if info.get("success") else 0.0
    if cfg.thought_pockets:  # off: the episode's final info is all a reward reads
        reward += sum(thought_reward(episode, cfg))
    if cfg.name == "sparse":
        return float(reward)
    start = max(info["optimal_steps"], 1)
    reward += cfg.progress * (start - info["distance_to_goal"]) / start
    reward -= cfg.step_cost * info["turns"]
    reward -= cfg.bump_penalty * info["bumps"]
    reward -= cfg.invalid_penalty * info["invalid_actions"]
    reward -= cfg.revisit_penalty * info["revisits"]
    reward -= cfg.wrong_stop_penalty * bool(info.get("stopped_wrong"))
    return float(reward)


def turn_rewards(episode, cfg) -> list[float]:
    """The episode reward split over its turns (they sum to ``episode_reward``): the BFS progress of each turn,
    its step cost, the bumps, invalid actions and revisits it added, and the success bonus on the last turn."""
    out, prev = [], {"distance_to_goal": None, "bumps": 0, "invalid_actions": 0, "revisits": 0}
    thought = thought_reward(episode, cfg)
    for k, info in enumerate(episode.infos):
        last = k == len(episode.infos) - 1
        r = cfg.success if last and info.get("success") else 0.0
        r += thought[k]
        if cfg.name != "sparse":
            start = max(info["optimal_steps"], 1)
            before = info["optimal_steps"] if prev["distance_to_goal"] is None else prev["distance_to_goal"]
            r += cfg.progress * (before - info["distance_to_goal"]) / start
            r -= cfg.step_cost
            r -= cfg.bump_penalty * (info["bumps"] - prev["bumps"])
            r -= cfg.invalid_penalty * (info["invalid_actions"] - prev["invalid_actions"])
            r -= cfg.revisit_penalty * (info["revisits"] - prev["revisits"])
            r -= cfg.wrong_stop_penalty * bool(info.get("stopped_wrong"))
        prev = info
        out.append(float(r))
    return out
