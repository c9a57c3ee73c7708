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

``interface`` picks the words the model reads and writes: ``vlmaze`` (the tiny CPU recipe's short
prompt, ``<action>up</action>``) or ``reference`` (the reference environment's: its task description
with the maze size, colours and numbered actions, ``('move', d)`` / ``('stop', 'stop')`` actions, its
feedback lines and a remaining-steps notice), so a checkpoint fine-tuned on the reference trains and
evaluates here without translation. The semantics are the same for both.
"""

from __future__ import annotations

import math
import string

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from maze.actions import INTERFACES, parse_action, parse_reference_action
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
# The reference's task description (content and action format are the reference's, the wording is vlmaze's).
REFERENCE_SYSTEM_PROMPT = (
    "You are navigating a {size}x{size} maze. The maze consists of walls (gray) and paths (white). You are "
    "represented by a blue circle, and your goal is to reach the red target square.\n\n"
    "Available actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
    "   - 0=right, 1=up, 2=left, 3=down\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`\n\n"
    "Success: you succeed only if you stop on the red target square; stopping anywhere else ends the session "
    "as a failure. Moving into a wall or an invalid action uses up a step.\n\n"
    "Think briefly, then respond with exactly one action in the specified format inside <action></action>, "
    "for example <action>('move', 1)</action> to move up or <action>('stop', 'stop')</action> to stop."
)
REFERENCE_TASK_PROMPT = "Here is the maze. You have {steps} steps."
REFERENCE_MOVED, REFERENCE_BUMP = "Action executed successfully.", "Cannot move into a wall."
MAX_TEXT = 4096
REFERENCE_TURNS, REFERENCE_SIZE = 20, 9  # the reference's budget: 20 turns at 9x9, the final stop included


def turn_budget(size: int, max_turns: int = REFERENCE_TURNS, ref_size: int = REFERENCE_SIZE) -> int:
    """Turns for a maze of ``size``: ``max_turns`` at ``ref_size`` and below, scaled by area above it."""
    return max(max_turns, math.ceil(max_turns * (size / ref_size) ** 2))


class MazeEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 9, generator: str = "wilson", braid: float = 0.0,
                 placement: str = "corners4", pixels_per_cell: int = 25, grid_lines: bool = False,
                 max_turns: int | None = None, require_stop: bool = True, max_moves_per_turn: int = 1,
                 render_mode: str | None = "rgb_array", pad_to: int = 1, pad_before: int = 0,
                 wall_gray: int = 169, view: str = "global", interface: str = "vlmaze"):
        if max_turns is not None and max_turns < 1:
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
        if interface not in INTERFACES:
            raise ValueError(f"interface must be one of {', '.join(INTERFACES)}, got {interface!r}")
        self.interface = interface
        if not 0 <= wall_gray <= 255:
            raise ValueError(f"wall_gray must be in [0, 255], got {wall_gray}")
        self.palette = Palette(wall=(int(wall_gray),) * 3)
        self._max_turns, self.require_stop = max_turns, require_stop  # None: turn_budget(maze size)
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
    def max_turns(self) -> int:
        """The episode's turn budget: as given, or the reference's scaled to the maze's size."""
        if self._max_turns is not None:
            return self._max_turns
        return turn_budget(self.maze.size if self.maze is not None else self.size)

    @property
    def system_prompt(self) -> str:
        """The conversation's system message (the reference's names the maze size)."""
        if self.interface == "reference":
            size = self.maze.size if self.maze is not None else self.size
            return REFERENCE_SYSTEM_PROMPT.format(size=size)
        return SYSTEM_PROMPT

    @property
    def task_prompt(self) -> str:
        if self.interface == "reference":
            return REFERENCE_TASK_PROMPT.format(steps=self.max_turns)
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
        reference = self.interface == "reference"
        parsed = (parse_reference_action(action_text) if reference
                  else parse_action(action_text, self.max_moves_per_turn))
        terminated = False
        if not parsed.valid:
            self.invalid_actions += 1
            event, feedback = "invalid", parsed.error if reference else f"Invalid action: {parsed.error}."
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
        if reference:
            feedback = self._reference_feedback(event, feedback)
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

    def _reference_feedback(self, event: str, feedback: str) -> str:
        """The reference's feedback line for ``event``, then how many steps remain."""
        line = {"move": REFERENCE_MOVED, "bump": REFERENCE_BUMP, "stop_goal": REFERENCE_MOVED,
                "stop_wrong": REFERENCE_MOVED, "arrive_goal": REFERENCE_MOVED}.get(event, feedback)
        left = self.max_turns - self.turns
        return f"{line} {left} step{'s' if left != 1 else ''} remaining."

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
