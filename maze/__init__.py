"""vlmaze's maze environment: generate, solve, render, parse actions, run episodes, eval sets.

    import maze
    env = maze.MazeEnv(size=9)                 # the CPU recipe's settings (maze.EnvSettings); **maze.REFERENCE_VIEW
    obs, info = env.reset(seed=0)              # obs = {"image": (160, 160, 3) uint8, "text": prompt}
    obs, reward, terminated, truncated, info = env.step("I go right. <action>right</action>")
"""

import gymnasium as gym
from PIL import Image

from maze.core import (
    GENERATORS,
    PLACEMENTS,
    Maze,
    distances_from,
    expert_actions,
    generate_maze,
    optimal_steps,
    shortest_path,
)
from maze.env import (
    REFERENCE_VIEW,
    SYSTEM_PROMPT,
    EnvSettings,
    MazeEnv,
    MazeRenderer,
    ParsedAction,
    parse_action,
    render,
    render_path,
)
from maze.sampler import TrainSampler
from maze.suites import EvalSuite, eval_hashes, eval_layouts, load_suite, suite_names

ENV_ID = "vlmaze/Maze-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="maze.env:MazeEnv")


def to_pil(image) -> Image.Image:
    """An observation image (H, W, 3) uint8 array as a PIL RGB image."""
    return Image.fromarray(image)


__all__ = [
    "ENV_ID", "GENERATORS", "PLACEMENTS", "REFERENCE_VIEW", "SYSTEM_PROMPT", "EnvSettings", "EvalSuite", "Maze",
    "MazeEnv", "MazeRenderer", "ParsedAction", "TrainSampler", "distances_from", "eval_hashes", "eval_layouts",
    "expert_actions", "generate_maze", "load_suite", "optimal_steps", "parse_action", "render", "render_path",
    "shortest_path", "suite_names", "to_pil",
]
