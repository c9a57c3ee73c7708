"""Does a policy read the maze from the image? A probe for SFT starts (not a speed benchmark).

    python bench/perception_probe.py checkpoints/tiny_sft --thought        # the CPU defaults: egocentric view
    python bench/perception_probe.py OLD/policy --view global --ppc 16 --pad-before 0 --wall-gray 169  # reference

On held-out expert conversations (wall follower, 10 % noisy turns) it reports the teacher-forced
accuracy of the trained tokens at room cells (odd row and column: the walls around the agent must
be read from pixels) and at passage cells (whose open directions follow from the heading alone),
once with each turn's own frame and once with the conversation's frames shuffled (the same maze, the
agent elsewhere; in the egocentric view the whole maze moves). A policy that reads the image loses
accuracy with the wrong frames; equal numbers
mean it is blind and its accuracy comes from text priors. It also prints how much the vision
tower's output varies across image tokens relative to its size (near 0: every token gets the same
vector, whatever the maze).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maze import TrainSampler  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.build import load_policy_dir  # noqa: E402
from models.forward import collate  # noqa: E402
from rl.experts import expert_trajectory  # noqa: E402
from rl.rollout import Conversation  # noqa: E402

DECISIONS = {"up", "down", "left", "right", "stop", "on"}
KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def turn_of_token(traj, tok) -> list[int]:
    """For each token, the index of the assistant turn it follows (-1 before the first)."""
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    out, turn, ids = [], -1, traj.token_ids
    for i in range(len(ids)):
        if i >= len(header) and ids[i - len(header):i] == header:
            turn += 1
        out.append(turn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--thought", action="store_true", help="the policy was trained with algo.sft_thought")
    ap.add_argument("--pad-before", type=int, default=EnvSettings.pad_before)
    ap.add_argument("--wall-gray", type=int, default=EnvSettings.wall_gray)
    ap.add_argument("--view", default="egocentric", choices=["global", "egocentric"])
    ap.add_argument("--ppc", type=int, default=EnvSettings.pixels_per_cell, help="env.pixels_per_cell")
    ap.add_argument("--mazes", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, processor = load_policy_dir(args.checkpoint)
    model.eval()
    tok = processor.tokenizer
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=args.ppc, pad_to=32, max_turns=30, pad_before=args.pad_before,
                      wall_gray=args.wall_gray, view=args.view)
    mazes = TrainSampler(sizes=(9,), seed=777).take(args.mazes + 1)
    trajs = [expert_trajectory(m, conv, env, "wall_follower", noise=0.1, seed=k, max_turns=30,
                               with_thought=args.thought) for k, m in enumerate(mazes)]
    acc = {mode: defaultdict(lambda: [0, 0]) for mode in ("own frames", "shuffled frames")}
    spreads = []
    for _k, t in enumerate(trajs[:-1]):
        shuffle = torch.randperm(len(t.images)).tolist()
        frames = {"own frames": t.images, "shuffled frames": [t.images[j] for j in shuffle[:len(t.images)]]}
        positions = [t.maze.start] + [i["position"] for i in t.infos]
        turns = turn_of_token(t, tok)
        for mode, images in frames.items():
            b = collate([t.token_ids], [images], tok.pad_token_id, model.config.image_token_id)
            with torch.no_grad():
                model.model.rope_deltas = None
                pred = model(**{key: v for key, v in b.items() if key in KEYS}).logits[0, :-1].argmax(-1)
                if mode == "own frames":
                    feats = model.model.get_image_features(b["pixel_values"][:b["image_grid_thw"][0].prod()],
                                                           b["image_grid_thw"][:1]).pooler_output[0]
                    spreads.append(float(feats.std(0).mean() / feats.abs().mean()))
            for i in range(1, len(t.token_ids)):
                if not t.loss_mask[i] or turns[i] < 0 or turns[i] >= len(positions):
                    continue
                if tok.decode([t.token_ids[i]]).strip() not in DECISIONS:
                    continue  # format tokens; only directions (thought and action) and stop count
                r, c = positions[turns[i]]
                kind = "goal" if (r, c) == t.maze.goal else "room" if r % 2 and c % 2 else "passage"
                acc[mode][kind][0] += int(pred[i - 1] == t.token_ids[i])
                acc[mode][kind][1] += 1
    print(f"checkpoint {args.checkpoint}: teacher-forced accuracy of decision tokens, {args.mazes} held-out mazes")
    for mode, table in acc.items():
        cells = "  ".join(f"{kind} {a / n:.3f} ({n})" for kind, (a, n) in sorted(table.items()))
        print(f"  {mode:22s} {cells}")
    own, other = acc["own frames"]["room"], acc["shuffled frames"]["room"]
    print(f"room_accuracy_drop_without_own_frames={own[0] / own[1] - other[0] / other[1]:.3f}")
    print(f"vision_token_spread={sum(spreads) / len(spreads):.4f}  (std across image tokens / mean |feature|)")


if __name__ == "__main__":
    main()
