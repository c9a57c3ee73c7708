"""The training stream: a deterministic sampler of training mazes (one kind, or a mixture ``env.train_mix``) that
never draws a layout any evaluation suite holds, reshaped by a curriculum (``env.curriculum``: size growth,
reverse starts, replay of failed mazes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maze.core import GENERATORS, Maze, generate_maze, shortest_path
from maze.suites import eval_layouts


@dataclass(frozen=True)
class MixItem:
    """One kind of training maze in a mixture (``env.train_mix``): drawn with probability ``weight`` / total."""

    size: int = 9
    generator: str = "wilson"
    braid: float = 0.0
    placement: str = "corners4"
    weight: float = 1.0


CURRICULA = ("none", "size", "reverse", "replay")


class TrainSampler:
    """Deterministic stream of training mazes that skips every layout found in an eval suite.

    The distribution is either the product ``sizes`` x ``generators`` (each drawn uniformly per maze) with one
    ``braid`` and ``placement``, or a weighted mixture ``mix`` of ``MixItem`` kinds. A ``curriculum`` reshapes it
    over training (``set_progress(f)``, f in [0, 1], set from the step, so a resumed run draws the same):

    - ``size``: only the kinds of size <= a limit growing linearly from the smallest to the largest size by
      f = 1 (the mix's weights renormalised over the kinds allowed);
    - ``reverse``: the start moves onto the shortest path, ``f`` of its length away from the goal (at least two
      cells), so early episodes start near the goal and later ones from the real start;
    - ``replay``: a share ``replay_fraction`` of each draw replays mazes the policy failed, sampled with weight
      (1 - their last group success rate) from a buffer of ``replay_capacity`` (``record`` fills it).

    Its state is ``position`` (candidates drawn) plus the replay buffer, so a checkpoint that saves
    ``state_dict()`` resumes the exact stream.
    """

    SEED_OFFSET = 1_000_000_000  # training seeds live far from the eval seeds (0..~100)

    def __init__(self, sizes=(9,), generators=("wilson",), braid: float = 0.0,
                 placement: str = "corners4", seed: int = 0, exclude: frozenset[str] | None = None,
                 max_skips: int = 10_000, mix: list[MixItem] | None = None, curriculum: str = "none",
                 replay_fraction: float = 0.5, replay_capacity: int = 256):
        for g in [*generators, *(m.generator for m in mix or [])]:
            if g not in GENERATORS:
                raise ValueError(f"unknown maze generator {g!r}; choose from {GENERATORS}")
        if curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {curriculum!r}; choose from {CURRICULA}")
        self.sizes, self.generators = [int(s) for s in sizes], list(generators)
        self.braid, self.placement, self.seed = float(braid), placement, int(seed)
        self.mix = list(mix or [])
        self.curriculum, self.progress = curriculum, 1.0 if curriculum == "none" else 0.0
        self.replay_fraction, self.replay_capacity = float(replay_fraction), int(replay_capacity)
        self.replay: list[tuple[Maze, float]] = []  # (maze, its last group success rate), oldest first
        self.exclude = eval_layouts() if exclude is None else exclude  # layout hashes
        self.max_skips, self.position, self.skipped = max_skips, 0, 0

    @classmethod
    def from_config(cls, env, seed: int) -> TrainSampler:
        """The sampler an ``env.*`` config describes (``conf/schema.EnvConfig``: train_sizes, generators, braid,
        placement or train_mix, and the curriculum keys)."""
        mix = [MixItem(int(m.size), str(m.generator), float(m.braid), str(m.placement), float(m.weight))
               for m in env.train_mix]
        return cls(sizes=list(env.train_sizes) or [env.size], generators=list(env.generators), braid=env.braid,
                   placement=env.placement, seed=seed, mix=mix, curriculum=env.curriculum,
                   replay_fraction=env.replay_fraction, replay_capacity=env.replay_capacity)

    def set_progress(self, fraction: float) -> None:
        self.progress = min(max(float(fraction), 0.0), 1.0)

    def allowed(self) -> list[MixItem]:
        """The mix's kinds the curriculum allows now (all of them unless ``size``)."""
        if self.curriculum != "size":
            return self.mix
        sizes = sorted({m.size for m in self.mix})
        limit = sizes[0] + self.progress * (sizes[-1] - sizes[0])
        return [m for m in self.mix if m.size <= limit + 1e-9]

    def _candidate(self, index: int) -> Maze:
        rng = np.random.default_rng([self.seed, index, 7])
        maze_seed = self.SEED_OFFSET + self.seed * 10_000_000 + index
        if self.mix:
            kinds = self.allowed()
            weights = np.array([m.weight for m in kinds], dtype=np.float64)
            k = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
            return generate_maze(k.size, maze_seed, k.generator, k.braid, k.placement)
        size = self.sizes[int(rng.integers(len(self.sizes)))]
        generator = self.generators[int(rng.integers(len(self.generators)))]
        return generate_maze(size, maze_seed, generator, self.braid, self.placement)

    def _reverse(self, maze: Maze) -> Maze:
        path = shortest_path(maze)  # start ... goal
        back = max(2, int(round(self.progress * (len(path) - 1))))
        if back >= len(path) - 1:
            return maze
        return Maze(maze.grid, path[len(path) - 1 - back], maze.goal, maze.seed, maze.generator, maze.braid,
                    "reverse")

    def __iter__(self):
        return self

    def __next__(self) -> Maze:
        for _ in range(self.max_skips):
            maze = self._candidate(self.position)
            self.position += 1
            if maze.layout_hash not in self.exclude:
                return self._reverse(maze) if self.curriculum == "reverse" else maze
            self.skipped += 1
        raise RuntimeError(f"train sampler skipped {self.max_skips} mazes in a row whose layouts are all in "
                           f"eval suites; sizes {self.sizes} have too few distinct layouts")

    def take(self, count: int) -> list[Maze]:
        """``count`` mazes; with ``replay``, the first ``replay_fraction`` of them drawn from the failure buffer."""
        replayed = []
        if self.curriculum == "replay" and self.replay:
            weights = np.array([1.0 - s for _, s in self.replay]) + 1e-3
            rng = np.random.default_rng([self.seed, self.position, 11])
            n = min(int(round(self.replay_fraction * count)), len(self.replay))
            picks = rng.choice(len(self.replay), size=n, replace=False, p=weights / weights.sum())
            replayed = [self.replay[int(i)][0] for i in picks]
        return replayed + [next(self) for _ in range(count - len(replayed))]

    def record(self, mazes: list[Maze], success: list[float]) -> dict[str, float]:
        """``replay``: remember each maze's group success rate (a replayed maze's entry is refreshed); the buffer
        keeps the newest ``replay_capacity``. Returns what to log."""
        if self.curriculum != "replay":
            return {}
        for maze, rate in zip(mazes, success):
            self.replay = [(m, s) for m, s in self.replay if m.content_hash != maze.content_hash]
            self.replay.append((maze, float(rate)))
        self.replay = self.replay[-self.replay_capacity:]
        fails = [1.0 - s for _, s in self.replay]
        return {"replay/buffer": float(len(self.replay)), "replay/buffer_failure_rate": float(np.mean(fails)),
                "replay/unsolved_share": float(np.mean([f == 1.0 for f in fails]))}

    def state_dict(self) -> dict:
        return {"position": self.position, "skipped": self.skipped, "seed": self.seed,
                "replay": [{"rows": m.to_rows(), "seed": m.seed, "generator": m.generator, "braid": m.braid,
                            "placement": m.placement, "success": s} for m, s in self.replay]}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for seed {state['seed']}, this sampler has {self.seed}")
        self.position, self.skipped = int(state["position"]), int(state["skipped"])
        self.replay = [(Maze.from_rows(r["rows"], r["seed"], r["generator"], r["braid"], r["placement"]),
                        float(r["success"])) for r in state.get("replay", [])]
