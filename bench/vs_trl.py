"""vlmaze's GRPO step vs TRL's ``GRPOTrainer`` on the same work.

Both sides: the same tiny Qwen3-VL (``build_tiny(0)``, identical fp32 weights), the same
single-turn maze prompts (system + image + task text), group size, mazes per step, max new
tokens, temperature 1.0, no KL (so no reference model on either side), one PPO epoch, AdamW at
the same lr, HF generation, and the same reward (1 when the first move is the BFS move). Each
side runs in its own child process (so peak RSS is its own), ``--warmup`` steps then
``--steps`` timed steps; medians are reported.

    pip install -r bench/requirements.txt
    python bench/vs_trl.py [--steps 6] [--warmup 1] [--group 8] [--mazes 4] [--max-new 24]

Prints per-phase times (generate, score, update), step time, trained tokens/s and peak RSS per
side, then the ratios; the last line is ``speedup_vs_trl=<TRL median step / vlmaze median step>``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from maze import TrainSampler  # noqa: E402
from maze.core import expert_actions  # noqa: E402
from maze.env import (
    MazeEnv,  # noqa: E402
    parse_action,  # noqa: E402
)
from models.tiny import build_tiny  # noqa: E402

LR, CLIP = 1e-4, 0.2


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def first_move_reward(text: str, maze) -> float:
    """1.0 when the first parsed move is the BFS expert's first move from the start, else 0."""
    parsed = parse_action(text, 1)
    return float(parsed.valid and bool(parsed.moves) and parsed.moves[0] == expert_actions(maze)[0])


def mazes_for(args) -> list:
    return TrainSampler(sizes=(9,), seed=11).take(args.mazes * (args.warmup + args.steps))


def observation(maze, ppc: int, pad: int):
    env = MazeEnv(size=maze.size, pixels_per_cell=ppc, pad_to=pad, turn_limit=1)
    obs, _ = env.reset(options={"maze": maze})
    return obs


# --------------------------------------------------------------------------- vlmaze side
def run_vlmaze(args) -> dict:
    from bench.common import GRPOStep
    from maze.env import EnvSettings

    torch.manual_seed(0)
    model, processor = build_tiny(0)
    env = EnvSettings(pixels_per_cell=args.ppc, pad_to=args.pad, max_turns=1)
    stepper = GRPOStep(model, processor, env, args.group, args.max_new, LR, CLIP, packing=True,
                       reward=lambda t: first_move_reward(t.actions[0], t.maze))
    all_mazes = mazes_for(args)
    times = {"generate": [], "score": [], "update": [], "step": []}
    tokens = []
    for step in range(args.warmup + args.steps):
        res = stepper(all_mazes[step * args.mazes:(step + 1) * args.mazes], seed=step)
        if step >= args.warmup:
            for k in times:
                times[k].append(res[k])
            tokens.append(res["tokens"])
    return {"times": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


# --------------------------------------------------------------------------- TRL side
def run_trl(args) -> dict:
    from datasets import Dataset
    from PIL import Image
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from maze.env import SYSTEM_PROMPT

    torch.manual_seed(0)
    model, processor = build_tiny(0)
    all_mazes = mazes_for(args)
    by_text = {}
    rows = []
    for k, m in enumerate(all_mazes):
        obs = observation(m, args.ppc, args.pad)
        text = obs["text"] + f" [maze {k}]"  # a tag so the reward finds the maze
        by_text[text] = m
        rows.append({"prompt": [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                     "image": Image.fromarray(obs["image"])})
    dataset = Dataset.from_list(rows)

    def reward(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            text = p[-1]["content"][-1]["text"]
            comp = c[0]["content"] if isinstance(c, list) else c
            out.append(first_move_reward(comp, by_text[text]))
        return out

    n = args.mazes * args.group
    cfg = GRPOConfig(output_dir=str(Path(args.tmp) / "trl"), per_device_train_batch_size=n,
                     num_generations=args.group, max_completion_length=args.max_new, temperature=1.0,
                     beta=0.0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                     epsilon=CLIP, max_grad_norm=1.0, loss_type="dapo", num_iterations=1,
                     gradient_checkpointing=False, use_cpu=True, bf16=False, fp16=False,
                     max_steps=args.warmup + args.steps, logging_steps=1, report_to=[], save_strategy="no",
                     shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=dataset,
                          processing_class=processor)
    times = {"generate": [], "score": [], "update": [], "step": []}
    tokens: list[float] = []
    phase = {}
    gen_and_score = trainer._generate_and_score_completions
    calc_rewards = trainer._calculate_rewards

    def timed_gen(inputs):
        t0 = time.perf_counter()
        phase["score_reward"] = 0.0
        out = gen_and_score(inputs)
        phase["gen_score"] = time.perf_counter() - t0
        phase["tokens"] = float(out["completion_mask"].sum())
        return out

    def timed_rewards(*a, **k):
        t0 = time.perf_counter()
        out = calc_rewards(*a, **k)
        phase["score_reward"] += time.perf_counter() - t0
        return out

    trainer._generate_and_score_completions = timed_gen
    trainer._calculate_rewards = timed_rewards

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            phase["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step > args.warmup:
                total = time.perf_counter() - phase["t0"]
                # TRL generates and scores (old/ref logprobs when needed, rewards, advantages) in one call;
                # everything outside it (rewards excluded) is the update.
                times["generate"].append(phase["gen_score"] - phase["score_reward"])
                times["score"].append(phase["score_reward"])
                times["update"].append(total - phase["gen_score"])
                times["step"].append(total)
                tokens.append(phase["tokens"])

    trainer.add_callback(Timer())
    trainer.train()
    return {"times": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


# --------------------------------------------------------------------------- driver
def summary(res: dict) -> dict:
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    med["tokens_per_s"] = statistics.median(tok / s for tok, s in zip(res["tokens"], res["times"]["step"]))
    med["peak_rss_mb"] = res["peak_rss_mb"]
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--mazes", type=int, default=4)
    ap.add_argument("--max-new", dest="max_new", type=int, default=24)
    ap.add_argument("--ppc", type=int, default=16)
    ap.add_argument("--pad", type=int, default=32)
    ap.add_argument("--side", choices=["vlmaze", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default="/tmp/vlmaze_vs_trl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        res = (run_vlmaze if args.side == "vlmaze" else run_trl)(args)
        print("RESULT " + json.dumps(res), flush=True)
        return

    results = {}
    for side in ("vlmaze", "trl"):
        cmd = [sys.executable, __file__, "--side", side] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                            vars(args).items() if k not in ("side",)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            sys.exit(f"bench/vs_trl.py: the {side} side failed (exit {proc.returncode}): "
                     f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        results[side] = summary(json.loads(line[0][len("RESULT "):]))
    v, t = results["vlmaze"], results["trl"]
    print(f"tiny Qwen3-VL fp32, {args.mazes} mazes x {args.group} samples, {args.max_new} new tokens, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'':10s} {'generate_s':>10s} {'score_s':>8s} {'update_s':>9s} {'step_s':>7s} {'tok/s':>8s} {'peak_MB':>8s}")
    for name, r in results.items():
        print(f"{name:10s} {r['generate']:10.3f} {r['score']:8.3f} {r['update']:9.3f} {r['step']:7.3f} "
              f"{r['tokens_per_s']:8.1f} {r['peak_rss_mb']:8.0f}")
    print(f"generate_ratio={t['generate'] / v['generate']:.2f} update_ratio={t['update'] / v['update']:.2f} "
          f"peak_rss_ratio(trl/vlmaze)={t['peak_rss_mb'] / v['peak_rss_mb']:.2f}")
    print(f"speedup_vs_trl={t['step'] / v['step']:.2f}")


if __name__ == "__main__":
    main()
