"""SFT's data: expert episodes as full multi-turn conversations (the recipe, its batch and loss: ``rl/sft.py``).

Experts: ``bfs`` (the shortest path from wherever the agent stands; the shipped start's), ``wall_follower``
(the right-hand rule; every decision depends only on the walls next to the agent and its heading) and
``greedy`` (depth-first search into the unvisited way nearest the goal, backing out of dead ends: navigation with
memory but no lookahead, 0.41 of ``fixed64``). With ``algo.sft_lookahead`` the thought names the dead-end
pockets next to the agent whatever the expert, so ``greedy`` + lookahead thoughts makes a start that sees the
pockets but does not act on them: what the thought says and what pays is left for GRPO to connect.

Each expert conversation is assembled exactly like a rollout (``rl.rollout.Conversation``), so
SFT trains on the token layout the policy will later sample in. The expert's turn is
``<action>MOVE</action><|im_end|>``; it ends with ``stop`` on the goal.

With ``thought`` (``algo.sft_thought``, default on) each expert turn first says what the agent
sees — ``<think>facing right; open up right</think><action>up</action>`` or ``<think>on the
goal</think><action>stop</action>``, or with ``algo.sft_lookahead=K`` ``<think>open up down left; not
down</think>`` (the open ways, and those that enter a pocket at most K cells deep; ``maze/thought.py``) —
the short thought the system prompt asks for. It gives every turn labels for what the move depends on, not
only the move.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from maze.core import MOVES, Maze
from maze.env import EnvSettings, agent_token, format_action
from maze.sampler import TrainSampler
from maze.thought import reading_target, thought
from rl.policies import ACT, START_HEADING
from rl.rollout import Conversation, Trajectory, TurnSample, start_episode, window_prompt

EXPERTS = ("bfs", "wall_follower", "greedy")
_EXPERT_POLICY = {"bfs": "oracle", "wall_follower": "wall_follower", "greedy": "greedy"}


def random_start(maze: Maze, rng) -> Maze:
    """``maze`` with its start moved to a uniformly random floor cell other than the goal.

    Conversations that start anywhere cannot be solved from the text alone (the corner start lets a
    policy dead-reckon its position from its own moves): the walls and the agent must be read from the
    image. The layout stays the training sampler's, which no eval suite holds, so no variant is an eval maze.
    """
    cells = [tuple(int(x) for x in rc) for rc in np.argwhere(maze.grid == 0) if tuple(rc) != maze.goal]
    return replace(maze, start=cells[int(rng.integers(len(cells)))], placement="random_start")


def expert_trajectory(maze: Maze, conv: Conversation, env: EnvSettings, expert: str = "bfs",
                      noise: float = 0.0, seed: int = 0, max_turns: int = 0,
                      with_thought: bool = False, lookahead: int = 0, aux_token: int | None = None) -> Trajectory:
    """One expert conversation; the expert answers from wherever the agent stands.

    ``noise`` > 0 injects off-expert turns (DART-style): with that probability a uniformly random
    move replaces the expert's, and that turn is left out of the loss (mask 0). The conversation
    then holds what the policy itself will meet — bumps, their feedback, detours — each followed by
    the expert's recovery, which is trained on. Without it the data never leaves the expert's path.
    ``max_turns`` cuts the conversation (0: twice the env's budget for the maze).
    ``with_thought`` prefixes each turn with ``thought(...)`` (trained on, except on noisy turns).
    ``aux_token``: each frame gets the visual auxiliary target (``ImageInput.target``): that merged token and
    ``reading_target`` at the agent's cell (``algo.sft_aux_weight``; ``lookahead`` deep).
    ``env.history=K``: each trained turn is also kept as its own ``TurnSample`` prompted exactly as a rollout
    prompts it (``window_prompt``: the task, the last K turns, its frame), so SFT trains the per-turn policy GRPO
    will sample; noisy turns are in the windows of later turns but are not samples.
    """
    if expert not in _EXPERT_POLICY:
        raise ValueError(f"unknown SFT expert {expert!r}; choose from {', '.join(EXPERTS)}")
    act = ACT[_EXPERT_POLICY[expert]]
    rng = np.random.default_rng([seed, *maze.grid.shape])
    budget = max_turns or 2 * env.turns_for(maze.size)
    e, t = start_episode(maze, conv, replace(env, max_moves_per_turn=1), max_turns=budget)
    if aux_token is not None:
        t.images[0].target = (aux_token, reading_target(maze, e.position, lookahead))
    parts = [{"image": t.images[0], "text": e.task_prompt}]
    state: dict = {}
    for turn in range(budget):
        at_goal = e.position == maze.goal
        think = thought(maze, e.position, state.get("heading", START_HEADING), lookahead) if with_thought else ""
        off = noise > 0 and not at_goal and rng.random() < noise
        move = list(MOVES)[int(rng.integers(4))] if off else act(e, state, rng)
        if not env.require_stop and move == "stop":
            break
        text = think + format_action(move, env.interface)
        ids = conv.tok.encode(text, add_special_tokens=False) + [conv.eos]
        if env.history is not None and not off:
            prompt, images = window_prompt(conv, parts, env.history, e.system_prompt)
            t.samples.append(TurnSample(prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * (len(prompt)
                                                                                                  + len(ids)),
                                        images, turn))
        t.append(ids, 0 if off else 1)
        t.actions.append(text)
        before = e.position
        obs, _, terminated, truncated, info = e.step(text)
        if e.position != before:
            state["heading"] = move  # the heading (wall follower, thought) is the last move that moved
        t.infos.append(info)
        if terminated or truncated or (not env.require_stop and e.position == maze.goal):
            t.append(conv.newline, 0)
            break
        image = conv.image(obs["image"])
        if aux_token is not None:
            image.target = (aux_token, reading_target(maze, e.position, lookahead))
        parts[-1].update(response=ids, closed=True)
        parts.append({"image": image, "text": obs["text"]})
        t.images.append(image)
        t.append(conv.next_turn(obs["text"], image, closed=True), 0)
        while env.max_images_in_context and len(t.images) > env.max_images_in_context:
            conv.drop_oldest_image(t)
    t.finish = "success" if t.success else "max_turns"
    return t


def expert_dataset(cfg, processor, env: EnvSettings) -> list[Trajectory]:
    """``algo.sft_mazes`` expert conversations from the training sampler's stream (``conf/algo`` sft keys);
    ``algo.sft_random_start`` of them start on a random floor cell."""
    a = cfg.algo
    conv = Conversation(processor, keep_pixels=False)  # pixels are recomputed when a batch is scored
    sampler = TrainSampler.from_config(cfg.env, cfg.trainer.seed)
    sampler.set_progress(1.0)  # a curriculum is GRPO's: SFT draws the whole distribution
    mazes = sampler.take(a.sft_mazes)
    if a.sft_random_start > 0:  # start anywhere: the position must be read from the image, not dead-reckoned
        rng = np.random.default_rng([cfg.trainer.seed, 7])
        mazes = [random_start(m, rng) if rng.random() < a.sft_random_start else m for m in mazes]
    return [expert_trajectory(m, conv, env, a.sft_expert, a.sft_noise, seed=cfg.trainer.seed * 100_003 + k,
                              max_turns=a.sft_max_turns, with_thought=a.sft_thought, lookahead=a.sft_lookahead,
                              aux_token=agent_token(m.size, env.pixels_per_cell, env.pad_to, env.pad_before)
                              if a.sft_aux_weight > 0 else None)  # conf/schema checked the view
            for k, m in enumerate(mazes)]
