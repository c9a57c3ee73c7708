"""vlmaze's maze environment: generate, solve, render, parse actions, run episodes, eval sets.

    import maze
    env = maze.MazeEnv(size=9)
    obs, info = env.reset(seed=0)              # obs = {"image": (225, 225, 3) uint8, "text": prompt}
    obs, reward, terminated, truncated, info = env.step("I go right. <action>right</action>")
"""

import gymnasium as gym
from PIL import Image

from maze.actions import ParsedAction, parse_action
from maze.core import GENERATORS, PLACEMENTS, Maze, generate_maze
from maze.env import SYSTEM_PROMPT, MazeEnv
from maze.evalsets import EvalSuite, TrainSampler, eval_hashes, load_suite, suite_names
from maze.render import MazeRenderer, render, render_path
from maze.solver import distances_from, expert_actions, optimal_steps, shortest_path

ENV_ID = "vlmaze/Maze-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="maze.env:MazeEnv")


def to_pil(image) -> Image.Image:
    """An observation image (H, W, 3) uint8 array as a PIL RGB image."""
    return Image.fromarray(image)


__all__ = [
    "ENV_ID", "GENERATORS", "PLACEMENTS", "SYSTEM_PROMPT", "EvalSuite", "Maze", "MazeEnv",
    "MazeRenderer", "ParsedAction", "TrainSampler", "distances_from", "eval_hashes",
    "expert_actions", "generate_maze", "load_suite", "optimal_steps", "parse_action", "render",
    "render_path", "shortest_path", "suite_names", "to_pil",
]
