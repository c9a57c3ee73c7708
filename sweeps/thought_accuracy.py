"""How well a policy's thoughts read its cell: greedy episodes on a suite, each turn's ``<think>`` compared with the
truth at the agent's cell.

- ``open``: the open directions it names (``open up down ...``) are exactly the open neighbours;
- ``pockets``: with ``--lookahead K`` (the SFT start's ``algo.sft_lookahead``), the ways it calls ``not ...`` are
  exactly the dead-end pockets at most K cells deep (``maze.core.dead_ends``); also the pockets it missed and the
  ways it called pockets that are not;
- ``junction``: at cells with three or more open neighbours, the share of moves that lower the BFS distance;
- ``moves into a pocket``: moves into a true pocket, and how many of them the thought had named (the move went
  against a thought that was right: an action fault, which reward can fix, rather than a reading fault); and all
  moves into a way the thought called a pocket;
- ``by depth``: of the true pockets at each depth (the shortest lookahead that sees the pocket closed), how many
  the thought named: whether reading fails on deep pockets (a flood fill the model must do in one forward pass)
  or on all of them;
- ``by way``: the same by the pocket's direction, and the ways named that are not pockets: whether reading depends
  on where the pocket lies in the image (the egocentric view puts the agent's cell off-centre in its merged token,
  ``env.pad_before``).

    python sweeps/thought_accuracy.py outputs/sft_look8/checkpoints/step_1024/policy --lookahead 8

About a minute for 32 mazes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def score(trajs, lookahead: int) -> tuple[dict[str, int], dict[int, list[int]], dict[str, list[int]]]:
    """Each turn's thought against the truth at the agent's cell (the module docstring's counts), the true
    pockets by depth as ``{depth: [named, true]}`` and by way as ``{way: [named, true, named but not]}``.
    ``trajs``: anything with ``maze``, ``actions`` (each turn's text) and ``infos`` (each turn's env info,
    ``position`` after the turn)."""
    from maze.core import MOVES, dead_ends, distances_from
    from maze.thought import against_thought, first_move, named_open, named_pockets, open_ways, pockets

    c = dict(turns=0, open=0, pockets=0, true_pockets=0, missed=0, false=0, junctions=0, junction_right=0,
             into_true=0, into_true_named=0, into_named=0)
    by_depth: dict[int, list[int]] = {}  # pocket depth (cells) -> [named, true]
    by_way = {k: [0, 0, 0] for k in MOVES}  # direction -> [named, true, named but not a pocket]
    for t in trajs:
        pos, dist = t.maze.start, distances_from(t.maze.grid, t.maze.goal)
        for text, info in zip(t.actions, t.infos):
            move = first_move(text)
            r, col = pos
            true_open = open_ways(t.maze, pos)
            true_not, named = pockets(t.maze, pos, lookahead), named_pockets(text)
            c["turns"] += 1
            c["open"] += named_open(text) == true_open
            c["pockets"] += named == true_not
            c["true_pockets"] += len(true_not)
            c["missed"] += len(true_not - named)
            c["false"] += len(named - true_not)
            for way in true_not:  # the pocket's depth: the shortest lookahead that sees it closed
                d = next(k for k in range(1, lookahead + 1) if way in dead_ends(t.maze, pos, k))
                by_depth.setdefault(d, [0, 0])[1] += 1
                by_depth[d][0] += way in named
                by_way[way][0] += way in named
                by_way[way][1] += 1
            for way in named - true_not:
                by_way.setdefault(way, [0, 0, 0])[2] += 1
            if move in true_not:  # walked into a pocket: had the thought named it?
                c["into_true"] += 1
                c["into_true_named"] += move in named
            c["into_named"] += against_thought(text)
            if len(true_open) >= 3:
                good = {k for k in true_open if dist[r + MOVES[k][0], col + MOVES[k][1]] < dist[r, col]}
                c["junctions"] += 1
                c["junction_right"] += move in good
            pos = tuple(info["position"])
    return c, by_depth, by_way


def main() -> None:
    from conf.recorded import recorded
    from maze.env import EnvSettings
    from maze.suites import load_suite
    from models.build import load_policy_dir
    from models.engines.base import SamplingParams
    from models.engines.hf import HFEngine
    from rl.rollout import rollout

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("policy", type=Path)
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--suite", default="select64")
    p.add_argument("--mazes", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()
    model, processor = load_policy_dir(args.policy)
    mazes = list(load_suite(args.suite).mazes[:args.mazes])
    env_record = recorded(args.policy, "env")  # the observation and history the policy was trained with
    env = EnvSettings.from_config(env_record) if env_record else EnvSettings()
    trajs = rollout(HFEngine(model, processor), processor, mazes, 1, env,
                    SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens))
    c, by_depth, by_way = score(trajs, args.lookahead)
    n = max(c["turns"], 1)
    print(f"{args.policy}: {args.suite} x {len(mazes)} greedy | solved {sum(t.success for t in trajs) / len(trajs):.3f}"
          f" | turns {c['turns']} | open right {c['open'] / n:.3f} | pockets right {c['pockets'] / n:.3f} "
          f"(true pockets {c['true_pockets']}, missed {c['missed']}, named but not {c['false']}) | junction moves "
          f"right {c['junction_right'] / max(c['junctions'], 1):.3f} of {c['junctions']} | moves into a pocket "
          f"{c['into_true']} (the thought had named {c['into_true_named']}) | moves against the thought "
          f"(into a way it called a pocket) {c['into_named']}")
    print("pockets named, by depth (cells): " + ", ".join(
        f"{d}: {n}/{tot} = {n / tot:.2f}" for d, (n, tot) in sorted(by_depth.items())))
    print("pockets named, by way (named but not a pocket): " + ", ".join(
        f"{w}: {n}/{tot} = {n / max(tot, 1):.2f} ({false})" for w, (n, tot, false) in by_way.items()))


if __name__ == "__main__":
    main()
