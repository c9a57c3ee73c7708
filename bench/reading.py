"""The reading benchmark: how well a policy's thoughts read its cell, one table row per checkpoint. Greedy episodes
on a suite (32 ``select64`` mazes by default), each turn's ``<think>`` compared with the truth at the agent's cell.

- ``open``: the open directions it names (``open up down ...``) are exactly the open neighbours;
- ``pockets``: with lookahead K (the start's ``algo.sft_lookahead``, read from the checkpoint's recorded config;
  ``--lookahead`` overrides), the ways it calls ``not ...`` are exactly the dead-end pockets at most K cells deep
  (``maze.core.dead_ends``); also the pockets it missed and the ways it called pockets that are not;
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

    python bench/reading.py checkpoints/tiny_sft_pockets4 checkpoints/tiny_sft outputs/<run>/checkpoints/step_80

    python bench/reading.py A B --fresh 256   # 256 fresh 9x9 mazes instead of a suite: rankings near the ceiling

Each argument is a policy directory or a checkpoint directory holding ``policy/``; each is played on the
observation it was trained with (its recorded ``env``). Prints one markdown table (a row per checkpoint) and, below
it, the counts the shares come from. About a minute per checkpoint for 32 mazes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


FRESH_SEED = 999  # --fresh: the sampler stream no training run uses (runs use trainer.seed 0, 1, 2, ...)


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


DEPTHS = ((1, 1), (2, 2), (3, 3), (4, None))  # the table's depth columns: 1, 2, 3 and 4 or deeper
HEADER = ("| checkpoint | lookahead | solved | open right | pockets right | true pockets: missed / named but not "
          "| named by depth 1 / 2 / 3 / 4+ | named by way up / down / left / right | junction moves right "
          "| moves into a pocket (named) | moves against the thought |")


def row(name: str, lookahead: int, solved: float, c: dict[str, int], by_depth: dict[int, list[int]],
        by_way: dict[str, list[int]]) -> str:
    """One markdown table row (``HEADER``'s columns) from ``score``'s counts; a share over nothing is ``-``."""
    def share(n: int, tot: int) -> str:
        return f"{n / tot:.2f}" if tot else "-"

    n = c["turns"]
    depth = []
    for lo, hi in DEPTHS:
        got = [v for d, v in by_depth.items() if d >= lo and (hi is None or d <= hi)]
        depth.append(share(sum(v[0] for v in got), sum(v[1] for v in got)))
    way = [share(v[0], v[1]) for v in by_way.values()][:4]
    return (f"| {name} | {lookahead} | {solved:.3f} | {share(c['open'], n)} | {share(c['pockets'], n)} "
            f"| {c['true_pockets']}: {c['missed']} / {c['false']} | {' / '.join(depth)} | {' / '.join(way)} "
            f"| {share(c['junction_right'], c['junctions'])} | {c['into_true']} ({c['into_true_named']}) "
            f"| {c['into_named']} |")


def policy_dir(path: Path) -> Path:
    """A policy directory from a policy or a checkpoint directory (``.../step_N`` holds ``policy/``)."""
    if (path / "policy" / "config.json").is_file():
        return path / "policy"
    if (path / "config.json").is_file():
        return path
    raise SystemExit(f"error: {path} is neither a policy directory nor a checkpoint holding policy/ (no config.json)")


def main() -> None:
    from conf.recorded import RecordError, recorded
    from maze.env import EnvSettings
    from maze.suites import load_suite
    from models.build import load_policy_dir
    from models.engines.base import SamplingParams
    from models.engines.hf import HFEngine
    from rl.rollout import rollout

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", type=Path, nargs="+")
    p.add_argument("--lookahead", type=int, default=None,
                   help="the pocket depth a thought is scored against (default: the checkpoint's recorded "
                        "algo.sft_lookahead, else its reward.thought_lookahead, else 8)")
    p.add_argument("--suite", default="select64")
    p.add_argument("--mazes", type=int, default=32)
    p.add_argument("--fresh", type=int, default=0,
                   help="instead of --suite: this many fresh 9x9 Wilson mazes (four corner pairs) from the training "
                        "sampler's stream for seed 999, which no run trains on (eval layouts skipped), the same for "
                        "every checkpoint: a ranking with more mazes than a suite holds (no layout is frozen)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()
    if args.lookahead is not None and args.lookahead < 1:
        raise SystemExit(f"error: --lookahead {args.lookahead}: a pocket is at least 1 cell deep")
    dirs = [policy_dir(c) for c in args.checkpoints]  # every argument checked before the first rollout
    try:
        records = [(recorded(d, "algo"), recorded(d, "reward"), recorded(d, "env")) for d in dirs]
    except RecordError as err:
        raise SystemExit(f"error: {err}") from None
    if args.fresh:
        from itertools import islice

        from maze.sampler import TrainSampler
        mazes, source = list(islice(TrainSampler(seed=FRESH_SEED), args.fresh)), f"{args.fresh} fresh 9x9 mazes"
    else:
        mazes = list(load_suite(args.suite).mazes[:args.mazes])
        source = f"{args.suite} x {len(mazes)} mazes"
    lines, details = [HEADER, "|" + " --- |" * HEADER.count(" | ") + " --- |"], []
    for name, path, (algo, reward, env_record) in zip(args.checkpoints, dirs, records):
        # a GRPO run records algo.sft_lookahead=0; its thought is its start's, which reward.thought_lookahead names
        lookahead = args.lookahead or algo.get("sft_lookahead") or reward.get("thought_lookahead") or 8
        model, processor = load_policy_dir(path)
        env = EnvSettings.from_config(env_record) if env_record else EnvSettings()
        trajs = rollout(HFEngine(model, processor), processor, mazes, 1, env,
                        SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens))
        c, by_depth, by_way = score(trajs, lookahead)
        # the episodes any policy could solve in the budget the env gave them (rl.evaluation's ceiling)
        solvable = sum(t.final_info["fewest_turns"] <= t.final_info["turn_budget"] for t in trajs)
        lines.append(row(str(name), lookahead, sum(t.success for t in trajs) / len(trajs), c, by_depth, by_way))
        details.append(f"{name}: turns {c['turns']}, junctions {c['junctions']}; named/true by depth "
                       + ", ".join(f"{d}: {v[0]}/{v[1]}" for d, v in sorted(by_depth.items()))
                       + "; named/true (named but not) by way "
                       + ", ".join(f"{w}: {v[0]}/{v[1]} ({v[2]})" for w, v in by_way.items()))
        print(lines[-1], flush=True)
    print(f"\nreading, {source}, greedy, one episode each ({solvable} of them solvable within the turn budget: "
          f"the ceiling {solvable / len(mazes):.3f}):\n")
    print("\n".join(lines))
    print()
    print("\n".join(details))


if __name__ == "__main__":
    main()
