"""``MazeEnv``: a Gymnasium environment that takes the model's text and answers with an image.

Observation: ``{"image": (H, W, 3) uint8 array, "text": str}``; at reset the text is the task
prompt, afterwards the feedback on the last action. The image is a numpy array rather than a
PIL image so that the observation lies in ``observation_space`` (``Image.fromarray`` or
``maze.to_pil`` makes a PIL image; HF processors take the array as is).

Semantics (reference: ``require_stop=True``): each call to ``step`` is one *turn*, whatever the
text. A turn's moves are applied in order until one hits a wall (a *bump*: the agent stays).
With ``require_stop`` the episode succeeds only on ``stop`` at the goal, and ``stop`` anywhere
else ends it as a failure; without it, arriving at the goal succeeds. An invalid action (see
``maze.actions``) costs a turn and is fed back. The episode is truncated after ``max_turns``.
The environment's own reward is sparse (1.0 on success); shaping lives in ``rl.rewards`` and
reads ``info``.
"""

from __future__ import annotations

import string

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from maze.actions import parse_action
from maze.core import MOVES, Maze, generate_maze
from maze.render import VIEWS, MazeRenderer, Palette, frame_side
from maze.solver import distances_from

SYSTEM_PROMPT = (
    "You are an agent in a maze seen from above. Gray cells are walls, white cells are floor, "
    "the blue disc is you and the red square is the goal. Each turn, think briefly, then give "
    "one action inside <action></action>: up, down, left, right, or stop when you are on the goal."
)
TASK_PROMPT = "Here is the maze. Reach the red goal."
MULTI_MOVE_HINT = " You may give up to {k} moves in one action, separated by commas."
MAX_TEXT = 4096


class MazeEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 9, generator: str = "wilson", braid: float = 0.0,
                 placement: str = "corners", pixels_per_cell: int = 25, grid_lines: bool = False,
                 max_turns: int = 40, require_stop: bool = True, max_moves_per_turn: int = 1,
                 render_mode: str | None = "rgb_array", pad_to: int = 1, pad_before: int = 0,
                 wall_gray: int = 169, view: str = "global"):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_moves_per_turn < 1:
            raise ValueError(f"max_moves_per_turn must be >= 1, got {max_moves_per_turn}")
        self.size, self.generator, self.braid, self.placement = size, generator, braid, placement
        self.pixels_per_cell, self.grid_lines, self.pad_to = pixels_per_cell, grid_lines, max(int(pad_to), 1)
        if pad_before < 0:
            raise ValueError(f"pad_before must be >= 0, got {pad_before}")
        self.pad_before = int(pad_before)
        if view not in VIEWS:
            raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
        self.view = view
        if not 0 <= wall_gray <= 255:
            raise ValueError(f"wall_gray must be in [0, 255], got {wall_gray}")
        self.palette = Palette(wall=(int(wall_gray),) * 3)
        self.max_turns, self.require_stop = max_turns, require_stop
        self.max_moves_per_turn, self.render_mode = max_moves_per_turn, render_mode
        self.action_space = spaces.Text(max_length=MAX_TEXT, charset=string.printable)
        self._set_observation_space(size)
        self.maze: Maze | None = None

    def _set_observation_space(self, size: int) -> None:
        self._space_size = size
        _, side = frame_side(size, self.pixels_per_cell, self.pad_to, self.pad_before, self.view)
        self.observation_space = spaces.Dict({
            "image": spaces.Box(0, 255, (side, side, 3), np.uint8),
            "text": spaces.Text(max_length=MAX_TEXT, charset=string.printable),
        })

    @property
    def task_prompt(self) -> str:
        hint = MULTI_MOVE_HINT.format(k=self.max_moves_per_turn) if self.max_moves_per_turn > 1 else ""
        return TASK_PROMPT + hint

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        maze = options.get("maze")
        if maze is None:
            if seed is None:
                seed = int(self.np_random.integers(2**31))
            maze = generate_maze(self.size, seed, self.generator, self.braid, self.placement)
        if maze.size != self._space_size:
            self._set_observation_space(maze.size)
        self.maze = maze
        self._renderer = MazeRenderer(maze, self.pixels_per_cell, self.grid_lines, self.palette,
                                      pad_to=self.pad_to, pad_before=self.pad_before, view=self.view)
        self._to_goal = distances_from(maze.grid, maze.goal)  # (N, N) int32
        self.position = maze.start
        self.path = [maze.start]
        self._visited = {maze.start}
        self.turns = self.moves = self.bumps = self.invalid_actions = self.revisits = 0
        self.success = self.stopped_wrong = False
        self.done = False
        return self._obs(self.task_prompt), self._info("reset")

    def step(self, action_text):
        if self.maze is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("episode is over; call reset()")
        self.turns += 1
        parsed = parse_action(action_text, self.max_moves_per_turn)
        terminated = False
        if not parsed.valid:
            self.invalid_actions += 1
            event, feedback = "invalid", f"Invalid action: {parsed.error}."
        elif parsed.moves == ("stop",):
            terminated = True
            if self.position == self.maze.goal:
                self.success, event, feedback = True, "stop_goal", "You stopped on the goal. Solved!"
            else:
                self.stopped_wrong, event = True, "stop_wrong"
                feedback = "You stopped, but you are not on the goal. Episode over."
        else:
            event, feedback = self._apply_moves(parsed.moves)
            if not self.require_stop and self.position == self.maze.goal:
                self.success, terminated = True, True
                event, feedback = "arrive_goal", feedback + " You reached the goal. Solved!"
        truncated = not terminated and self.turns >= self.max_turns
        if truncated:
            feedback += " Out of turns."
        self.done = terminated or truncated
        reward = 1.0 if self.success else 0.0
        return self._obs(feedback), reward, terminated, truncated, self._info(event)

    def render(self):
        return self._renderer.frame(self.position)

    # ------------------------------------------------------------------ internals
    def _apply_moves(self, moves: tuple[str, ...]) -> tuple[str, str]:
        done = []
        for move in moves:
            dr, dc = MOVES[move]
            nxt = (self.position[0] + dr, self.position[1] + dc)
            if not self.maze.is_floor(nxt):
                self.bumps += 1
                prefix = f"You moved {', '.join(done)}, then " if done else "You "
                return "bump", prefix + f"hit a wall going {move} and did not move."
            self.position = nxt
            self.moves += 1
            self.path.append(nxt)
            if nxt in self._visited:
                self.revisits += 1
            self._visited.add(nxt)
            done.append(move)
            if not self.require_stop and nxt == self.maze.goal:
                break
        return "move", f"You moved {', '.join(done)}."

    def _obs(self, text: str) -> dict:
        return {"image": self._renderer.frame(self.position), "text": text}

    def _info(self, event: str) -> dict:
        return {
            "event": event,
            "position": self.position,
            "turns": self.turns,
            "moves": self.moves,
            "bumps": self.bumps,
            "invalid_actions": self.invalid_actions,
            "revisits": self.revisits,
            "visited_cells": len(self._visited),
            "optimal_steps": int(self._to_goal[self.maze.start]),
            "distance_to_goal": int(self._to_goal[self.position]),
            "success": self.success,
            "stopped_wrong": self.stopped_wrong,
            "maze_hash": self.maze.content_hash,
        }
