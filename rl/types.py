"""Trajectory: one multi-turn episode as the exact token ids the engine produced and saw."""

from __future__ import annotations

from dataclasses import dataclass, field

from maze.core import Maze
from models.engines.base import ImageInput


@dataclass
class Trajectory:
    maze: Maze
    group: int  # index of the maze within the step (all G samples of a group share it)
    token_ids: list[int] = field(default_factory=list)  # (T,) the whole conversation
    loss_mask: list[int] = field(default_factory=list)  # (T,) 1 on model-written tokens
    rollout_logprobs: list[float] = field(default_factory=list)  # (T,) engine logprobs; 0 where mask 0
    images: list[ImageInput] = field(default_factory=list)  # images still in the context, in order
    actions: list[str] = field(default_factory=list)  # decoded text of each assistant turn
    infos: list[dict] = field(default_factory=list)  # env info after each turn
    finish: str = ""  # success | stop_wrong | max_turns | context
    reward: float = 0.0  # set by rl.rewards
    images_dropped: int = 0  # images removed by env.max_images_in_context

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        """Extend the sequence by ``ids``, all with loss ``mask``; logprobs default to 0 (not sampled)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def success(self) -> bool:
        return bool(self.infos and self.infos[-1]["success"])

    @property
    def num_turns(self) -> int:
        return len(self.actions)

    @property
    def final_info(self) -> dict:
        return self.infos[-1] if self.infos else {}

    @property
    def path(self) -> list[tuple[int, int]]:
        return [self.maze.start] + [tuple(i["position"]) for i in self.infos]

    @property
    def response_tokens(self) -> int:
        return int(sum(self.loss_mask))


def finish_reason(info: dict) -> str:
    """How an episode that the env ended finished: success | stop_wrong | max_turns."""
    return "success" if info["success"] else ("stop_wrong" if info["stopped_wrong"] else "max_turns")
