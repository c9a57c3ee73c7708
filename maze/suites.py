"""The frozen evaluation suites. They live in ``maze/data/eval_sets.json`` as text grids with content hashes, so they do
not drift when generator code changes. ``python -m maze --freeze`` rewrites that file
from ``SUITE_SPECS`` (only do this on purpose: it changes every reported number).

``fixed64`` is the reference's own evaluation set: the 64 mazes its environment (``maze_2d/easy``,
9x9 Wilson) produces for ``reset(seed=i)``, i = 0..63, each with its start and goal (one of four
corner pairs), copied in seed order from ``REFERENCE_FILE`` when freezing. ``select64`` is a second
set from the same distribution (vlmaze's Wilson generator, ``corners4``) for choosing recipes, so
``fixed64`` stays a test set. The other suites are held out from training: other sizes, each
generator, braided mazes (several routes, so loops are possible), all with the reference's four
corner pairs, and random placement. No two suites share a layout (grid), and training
(``TrainSampler``) never draws a layout that any suite holds, whatever its start and goal.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from maze.core import Maze, generate_maze

DATA_FILE = Path(__file__).parent / "data" / "eval_sets.json"
# The reference's 64 evaluation mazes (data produced by running the reference environment), read by --freeze.
REFERENCE_FILE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "maze2d_easy_seeds0-63.json"

# name -> (description, generate_maze kwargs, number of mazes)
SUITE_SPECS: dict[str, tuple[str, dict, int]] = {
    "fixed64": ("the reference's 64 evaluation mazes: maze_2d/easy 9x9, reset(seed=i) for i = 0..63, "
                "four corner pairs", dict(size=9, generator="wilson", placement="corners4"), 64),
    "select64": ("recipe selection: 64 more 9x9 Wilson mazes, four corner pairs (choose recipes here, "
                 "report on fixed64)", dict(size=9, generator="wilson", placement="corners4"), 64),
    "size7": ("smaller than trained: 7x7 Wilson, four corner pairs",
              dict(size=7, generator="wilson", placement="corners4"), 32),
    "size11": ("maze_hard: 11x11 Wilson, four corner pairs",
               dict(size=11, generator="wilson", placement="corners4"), 32),
    "size13": ("larger than trained: 13x13 Wilson, four corner pairs",
               dict(size=13, generator="wilson", placement="corners4"), 32),
    "size15": ("larger than trained: 15x15 Wilson, four corner pairs",
               dict(size=15, generator="wilson", placement="corners4"), 32),
    "gen_backtracker": ("9x9 recursive backtracker (long corridors), four corner pairs",
                        dict(size=9, generator="backtracker", placement="corners4"), 32),
    "gen_prim": ("9x9 randomised Prim (many short dead ends), four corner pairs",
                 dict(size=9, generator="prim", placement="corners4"), 32),
    "gen_kruskal": ("9x9 randomised Kruskal, four corner pairs",
                    dict(size=9, generator="kruskal", placement="corners4"), 32),
    "braided": ("9x9 Wilson with half the dead ends opened (loops possible), four corner pairs",
                dict(size=9, generator="wilson", braid=0.5, placement="corners4"), 32),
    "random_placement": ("9x9 Wilson, start and goal random rooms at BFS distance >= 9",
                         dict(size=9, generator="wilson", placement="random", min_distance=9), 32),
    # unseen kinds: what no training mixture of the shipped recipes draws (appended, so the suites above keep
    # their mazes)
    "size17": ("larger than any trained size: 17x17 Wilson, four corner pairs",
               dict(size=17, generator="wilson", placement="corners4"), 32),
    "gen_sidewinder": ("9x9 sidewinder (a generator no shipped mixture trains on), four corner pairs",
                       dict(size=9, generator="sidewinder", placement="corners4"), 32),
    "braided11": ("11x11 Wilson with half the dead ends opened (several routes), four corner pairs",
                  dict(size=11, generator="wilson", braid=0.5, placement="corners4"), 32),
    "braided13": ("13x13 Wilson with half the dead ends opened (several routes), four corner pairs",
                  dict(size=13, generator="wilson", braid=0.5, placement="corners4"), 32),
    # recipe selection at other sizes (choose training mixtures and curricula here, report on the suites above)
    "select7": ("recipe selection: 32 more 7x7 Wilson mazes, four corner pairs",
                dict(size=7, generator="wilson", placement="corners4"), 32),
    "select11": ("recipe selection: 32 more 11x11 Wilson mazes, four corner pairs",
                 dict(size=11, generator="wilson", placement="corners4"), 32),
}


def reference_mazes(path: Path = REFERENCE_FILE) -> list[Maze]:
    """The reference's 64 evaluation mazes, in seed order, from its data file (grid, start, goal)."""
    if not path.is_file():
        raise FileNotFoundError(f"the reference's maze file is not at {path}; freezing fixed64 needs it")
    raw = json.loads(path.read_text())
    mazes = []
    for rec in sorted(raw["mazes"], key=lambda r: r["seed"]):
        grid = np.array(rec["grid"], dtype=np.uint8)
        mazes.append(Maze(grid, tuple(rec["start"]), tuple(rec["goal"]), int(rec["seed"]), "wilson",
                          0.0, "corners4"))
    if [m.seed for m in mazes] != list(range(64)):
        raise ValueError(f"{path} must hold the reference's seeds 0-63")
    return mazes


@dataclass(frozen=True)
class EvalSuite:
    name: str
    description: str
    mazes: tuple[Maze, ...]

    def __len__(self) -> int:
        return len(self.mazes)


def _build_suites(reference: Path = REFERENCE_FILE) -> dict[str, list[Maze]]:
    seen: set[str] = set()  # layout hashes: no two suites share a grid
    suites = {"fixed64": reference_mazes(reference)}
    seen.update(m.layout_hash for m in suites["fixed64"])
    for name, (_, kwargs, count) in SUITE_SPECS.items():
        if name == "fixed64":
            continue
        mazes, seed = [], 0  # every suite starts at seed 0; layouts already in a suite are skipped
        while len(mazes) < count:
            maze = generate_maze(seed=seed, **kwargs)
            seed += 1
            if maze.layout_hash in seen:
                continue
            seen.add(maze.layout_hash)
            mazes.append(maze)
        suites[name] = mazes
    return suites


def freeze(path: Path = DATA_FILE, reference: Path = REFERENCE_FILE) -> None:
    """Write every suite to ``path`` (text grids + hashes)."""
    out = {"version": 2, "suites": {}}
    for name, mazes in _build_suites(reference).items():
        out["suites"][name] = {
            "description": SUITE_SPECS[name][0],
            "mazes": [{"rows": m.to_rows(), "seed": m.seed, "generator": m.generator,
                       "braid": m.braid, "placement": m.placement, "hash": m.content_hash}
                      for m in mazes],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


@cache
def _load_file(path: str) -> dict[str, EvalSuite]:
    raw = json.loads(Path(path).read_text())
    suites = {}
    for name, entry in raw["suites"].items():
        mazes = []
        for rec in entry["mazes"]:
            maze = Maze.from_rows(rec["rows"], rec["seed"], rec["generator"], rec["braid"],
                                  rec["placement"])
            if maze.content_hash != rec["hash"]:
                raise ValueError(f"eval suite {name!r} in {path} is corrupt: maze seed {rec['seed']} "
                                 f"hashes to {maze.content_hash}, file says {rec['hash']}")
            mazes.append(maze)
        suites[name] = EvalSuite(name, entry["description"], tuple(mazes))
    return suites


def suite_names() -> list[str]:
    return list(_load_file(str(DATA_FILE)))


def load_suite(name: str) -> EvalSuite:
    suites = _load_file(str(DATA_FILE))
    if name not in suites:
        raise KeyError(f"unknown eval suite {name!r}; available: {', '.join(suites)}")
    return suites[name]


def eval_hashes() -> frozenset[str]:
    """Content hashes of every maze in every frozen suite."""
    return frozenset(m.content_hash for s in _load_file(str(DATA_FILE)).values() for m in s.mazes)


def eval_layouts() -> frozenset[str]:
    """Layout (grid) hashes of every maze in every frozen suite: what training must never draw."""
    return frozenset(m.layout_hash for s in _load_file(str(DATA_FILE)).values() for m in s.mazes)


def main() -> None:
    parser = argparse.ArgumentParser(description="List or rewrite the frozen evaluation suites.")
    parser.add_argument("--freeze", action="store_true", help=f"rewrite {DATA_FILE}")
    parser.add_argument("--reference", type=Path, default=REFERENCE_FILE,
                        help="the reference's maze file that fixed64 is frozen from")
    parser.add_argument("--list", action="store_true", help="list the frozen suites")
    args = parser.parse_args()
    if args.freeze:
        freeze(reference=args.reference)
        print(f"wrote {DATA_FILE}")
    for name in suite_names():
        suite = load_suite(name)
        print(f"{name:18s} {len(suite):3d} mazes  {suite.description}")


if __name__ == "__main__":
    main()
