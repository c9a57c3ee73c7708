"""GPU check for a lent H200: the Qwen3-VL-8B architecture (random weights, built from its known
config: nothing is downloaded) trained with FSDP2 in bf16 on multi-turn maze conversations, and
the hf engine's generation on maze rollouts. Prints tokens/s, step time and MFU against 989
TFLOP/s (H100/H200 dense bf16). Run through ``bench/gpu_check.sh`` (under 8 minutes).

    torchrun --nproc-per-node=1 bench/gpu_check.py [--seqs 8] [--steps 4] [--turns 8]
    python bench/gpu_check.py --tiny      # the same code path on CPU with a reduced config

MFU counts 6 * params * trained tokens per step (attention flops not counted, so it is a lower bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PEAK_BF16 = 989e12


def qwen3_vl_8b_config(tok, tiny: bool):
    """Qwen3-VL-8B-Instruct's architecture (text 36 x 4096, vision 27 x 1152, deepstack 8/16/24)."""
    from transformers import Qwen3VLConfig

    ids = tok.convert_tokens_to_ids
    text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
    if tiny:  # same code path, a config that fits a CPU
        text.update(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=1024,
                    rope_parameters={**text["rope_parameters"], "mrope_section": [12, 10, 10]})
        vision.update(depth=3, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
                      deepstack_visual_indexes=[0, 1, 2])
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                         video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                         vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seqs", type=int, default=8, help="conversations per training step")
    ap.add_argument("--steps", type=int, default=4, help="timed training steps (after 1 warm-up)")
    ap.add_argument("--turns", type=int, default=8, help="turns per training conversation")
    ap.add_argument("--ppc", type=int, default=32, help="pixels per cell (32: one image token per cell)")
    ap.add_argument("--gen-mazes", dest="gen_mazes", type=int, default=8)
    ap.add_argument("--gen-group", dest="gen_group", type=int, default=4)
    ap.add_argument("--gen-turns", dest="gen_turns", type=int, default=4)
    args = ap.parse_args()

    from transformers import Qwen3VLForConditionalGeneration

    from maze import TrainSampler
    from models.engines.base import SamplingParams, banned_token_ids
    from models.engines.hf import HFEngine
    from models.tiny import build_tiny
    from rl.packing import packed_token_logprobs
    from rl.rollout import Conversation, EnvSettings, rollout
    from rl.sft import expert_trajectory

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    _, processor = build_tiny(0)  # its image processor is Qwen3-VL's (patch 16, merge 2); token ids < 512
    tok = processor.tokenizer
    config = qwen3_vl_8b_config(tok, args.tiny)
    t0 = time.perf_counter()
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}; model {n_params / 1e9:.2f} B params "
          f"({dtype}), built in {time.perf_counter() - t0:.1f} s", flush=True)
    if torch.distributed.is_initialized():
        from models.distributed import wrap_fsdp2

        wrap_fsdp2(model)
        print(f"FSDP2 over {torch.distributed.get_world_size()} rank(s)", flush=True)

    # ---- training: multi-turn maze conversations (BFS expert), packed, bf16, AdamW
    env = EnvSettings(pixels_per_cell=args.ppc, pad_to=32, max_turns=args.turns)
    conv = Conversation(processor)
    mazes = TrainSampler(sizes=(9,), seed=0).take(args.seqs * (args.steps + 1))
    data = [expert_trajectory(m, conv, env, "bfs", noise=0.2, seed=k, max_turns=args.turns)
            for k, m in enumerate(mazes)]
    banned = banned_token_ids(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    times, tokens = [], []
    for step in range(args.steps + 1):
        batch = data[step * args.seqs:(step + 1) * args.seqs]
        for t in batch:
            for im in t.images:
                im.pixel_values = im.pixels().to(device, dtype)
                im.grid_thw = im.grid_thw.to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.train()
        lp = packed_token_logprobs(model, [t.token_ids for t in batch], [t.images for t in batch],
                                   tok.pad_token_id, config.image_token_id, banned, 1.0)
        mask = torch.zeros_like(lp)
        for r, t in enumerate(batch):
            mask[r, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=lp.dtype, device=lp.device)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
            tokens.append(sum(len(t.token_ids) for t in batch))
    step_s = statistics.median(times)
    tok_s = statistics.median(n / s for n, s in zip(tokens, times))
    mfu = 6 * n_params * tok_s / PEAK_BF16
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    print(f"train: {args.seqs} conversations x {args.turns} turns, {statistics.median(tokens):.0f} tokens/step; "
          f"step {step_s:.2f} s; {tok_s:,.0f} trained tokens/s; MFU {mfu:.1%} (6ND / 989 TFLOP/s); "
          f"peak memory {mem:.1f} GiB", flush=True)

    # ---- generation: the hf engine on B mazes x G samples x turns (an unsharded copy is what train.py
    # generates with under FSDP2; on one GPU the sharded model is the whole model)
    model.eval()
    engine = HFEngine(model, processor)
    genv = EnvSettings(pixels_per_cell=args.ppc, pad_to=32, max_turns=args.gen_turns)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, seed=0)
    gmazes = TrainSampler(sizes=(9,), seed=1).take(args.gen_mazes)
    t0 = time.perf_counter()
    trajs = rollout(engine, processor, gmazes, args.gen_group, genv, sampling)
    if cuda:
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    generated = sum(sum(t.loss_mask) for t in trajs)
    print(f"generate: {args.gen_mazes} mazes x {args.gen_group} samples x {args.gen_turns} turns, {generated} tokens "
          f"in {gen_s:.1f} s = {generated / gen_s:,.0f} generated tokens/s", flush=True)
    print(f"gpu_check step_s={step_s:.3f} train_tokens_per_s={tok_s:.0f} mfu={mfu:.4f} "
          f"generate_tokens_per_s={generated / gen_s:.0f}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
