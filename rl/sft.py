"""SFT warm start: expert episodes as full multi-turn conversations (loss on assistant tokens).

Experts: ``bfs`` (the shortest path; a global plan) and ``wall_follower`` (the right-hand rule;
every decision depends only on the walls next to the agent and its heading, which the previous
action gives). A ~1 M-parameter model can learn the local rule from pixels far more easily than
BFS planning, so the tiny CPU recipe starts from ``wall_follower``; GRPO then has room to learn
shortcuts the rule does not take.

Each expert conversation is assembled exactly like a rollout (``rl.rollout.Conversation``), so
SFT trains on the token layout the policy will later sample in. The expert's turn is
``<action>MOVE</action><|im_end|>``; it ends with ``stop`` on the goal.
"""

from __future__ import annotations

from maze.core import Maze
from maze.solver import expert_actions
from rl.rollout import Conversation, EnvSettings, start_episode
from rl.types import Trajectory

EXPERTS = ("bfs", "wall_follower")


def expert_moves(maze: Maze, expert: str, require_stop: bool) -> list[str]:
    """The expert's moves from the start; ``stop`` appended when the env requires it."""
    if expert == "bfs":
        moves = expert_actions(maze)
    elif expert == "wall_follower":
        from rl.policies import play

        moves = [a[len("<action>"):-len("</action>")] for a in
                 play("wall_follower", [maze], EnvSettings(max_turns=10 * maze.size**2), 0)[0].actions][:-1]
    else:
        raise ValueError(f"unknown SFT expert {expert!r}; choose from {', '.join(EXPERTS)}")
    return moves + (["stop"] if require_stop else [])


def expert_trajectory(maze: Maze, conv: Conversation, env: EnvSettings, expert: str = "bfs") -> Trajectory:
    e, t = start_episode(maze, conv, EnvSettings(**{**env.__dict__, "max_moves_per_turn": 1}), max_turns=10**6)
    moves = expert_moves(maze, expert, env.require_stop)
    for k, move in enumerate(moves):
        text = f"<action>{move}</action>"
        ids = conv.tok.encode(text, add_special_tokens=False) + [conv.eos]
        t.append(ids, 1)
        t.actions.append(text)
        obs, _, terminated, truncated, info = e.step(text)
        t.infos.append(info)
        if terminated or truncated or k == len(moves) - 1:
            t.append(conv.newline, 0)
            break
        image = conv.image(obs["image"])
        t.images.append(image)
        t.append(conv.next_turn(obs["text"], image, closed=True), 0)
        while env.max_images_in_context and len(t.images) > env.max_images_in_context:
            conv.drop_oldest_image(t)
    t.finish = "success" if t.success else "max_turns"
    return t
