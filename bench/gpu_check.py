"""GPU check, part 2: a training step of the Qwen3-VL-8B architecture's layer shapes (random weights, built from
its known config: nothing is downloaded) with as many decoder layers as the memory plan says fit one GPU, in
train.py's precision and code path: fp32 master weights and AdamW, FSDP2 (world size 1) casting to bf16 for
compute, gradient checkpointing, ``rl.update.accumulate`` over multi-turn maze conversations in the reference's
interface. Prints the layers, the attention implementation that ran, step time, tokens/s, MFU, the measured
peak memory beside the plan's figure (``models.memory``) for that depth (exits 1 when they differ by > 15 %), the
logprob gap of a packed micro-batch against padded rows under the device's attention kernel (exits 1 above 0.05:
trajectories that attend to each other are off by O(1)), and the time to write, hash and verify a checkpoint of
that model as a run does.

    torchrun --standalone --nproc-per-node=1 bench/gpu_check.py [--seqs 4] [--steps 2] [--turns 20]
    torchrun --standalone --nproc-per-node=1 bench/gpu_check.py --tiny     # the same code on CPU (gloo)

MFU counts 6 x params x trained tokens per step against 989 TFLOP/s (H100/H200 dense bf16); attention flops are
not counted, so it is a lower bound.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PEAK_BF16 = 989e12
PACKED_GAP = 0.05  # bf16 rounding differs between a packed and a padded forward; mixed trajectories are off by O(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small config on CPU: the same code path")
    ap.add_argument("--seqs", type=int, default=4, help="conversations per training step")
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed training steps (after 1 warm-up)")
    ap.add_argument("--turns", type=int, default=20, help="turns per training conversation")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: as many as the plan fits)")
    ap.add_argument("--fit", type=float, default=0.80, help="fraction of GPU memory the plan may use")
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from conf.schema import AlgoConfig
    from maze import TrainSampler
    from maze.env import EnvSettings
    from models import memory
    from models.distributed import wrap_fsdp2
    from models.engines.base import banned_token_ids
    from models.forward import packs_into_one_row
    from models.tiny import build_tiny
    from rl import checkpoint as ckpt_io
    from rl import sft
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation
    from rl.update import Scoring, StepBatch, accumulate, logprobs

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    compute = torch.bfloat16
    _, processor = build_tiny(0)  # its image processor is Qwen3-VL's (patch 16, merge 2); token ids < 512
    tok = processor.tokenizer
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [("image_token_id", "<|image_pad|>"),
                                                        ("video_token_id", "<|video_pad|>"),
                                                        ("vision_start_token_id", "<|vision_start|>"),
                                                        ("vision_end_token_id", "<|vision_end|>")]}

    # ---- data: BFS expert conversations in the reference's interface (global view, 25 px cells, 225 px frames)
    env = EnvSettings(view="global", pixels_per_cell=25, pad_to=1, pad_before=0, wall_gray=169, interface="reference",
                      max_turns=args.turns)
    conv = Conversation(processor)
    mazes = TrainSampler(sizes=(9,), seed=0).take(args.seqs * (args.steps + 1))
    data = [expert_trajectory(m, conv, env, "bfs", noise=0.2, seed=k, max_turns=args.turns)
            for k, m in enumerate(mazes)]
    longest = max(len(t.token_ids) for t in data)

    # ---- depth: the largest number of 8B-shaped decoder layers whose plan fits
    def config(layers: int):
        c = memory.arch_config("qwen3_vl_8b", layers=layers, token_ids=ids)
        if args.tiny:
            c.text_config.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, vocab_size=1024))
            c.text_config.rope_parameters["mrope_section"] = [12, 10, 10]
            c.vision_config.update(dict(depth=3, hidden_size=128, intermediate_size=256, num_heads=2,
                                        out_hidden_size=256, deepstack_visual_indexes=[0, 1, 2]))
        return c

    def plan_for(layers: int) -> dict:
        return memory.plan(memory.count_units(config(layers)), world=1, compute_bytes=2, engine="none", kl=False,
                           tokens=args.micro_batch * longest, grad_ckpt=True)

    def update_peak(p: dict) -> float:  # what one training step holds at most: backward or the optimizer step
        return max(p["totals"]["train"], p["totals"]["optimizer"])

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    layers = args.layers or (2 if args.tiny else max(
        [k for k in range(1, 37) if update_peak(plan_for(k)) <= args.fit * gpu_bytes] or [1]))
    cfg = config(layers)
    from models.build import attn_implementation

    attn = attn_implementation("auto", "cuda" if cuda else "cpu", str(compute).removeprefix("torch."))
    t0 = time.perf_counter()
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable()
    wrap_fsdp2(model, compute)
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}; torch {torch.__version__}; "
          f"8B layer shapes with {layers} of 36 decoder layers: {n_params / 1e9:.2f} B params, fp32 masters, "
          f"{compute} compute (FSDP2, world 1); attention: text {model.config.text_config._attn_implementation}, "
          f"vision {model.config.vision_config._attn_implementation}; built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    algo = OmegaConf.structured(AlgoConfig(micro_batch=args.micro_batch))
    scoring = Scoring(tok.pad_token_id, ids["image_token_id"], banned_token_ids(tok, cfg.text_config.vocab_size), 1.0,
                      share_images=False, compute_dtype=compute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)
    times, tokens = [], []
    for step in range(args.steps + 1):
        batch = data[step * args.seqs:(step + 1) * args.seqs]
        width = max(len(t.token_ids) for t in batch)
        mask = torch.zeros((len(batch), width))
        for r, t in enumerate(batch):
            mask[r, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        sb = StepBatch(batch, mask, torch.zeros_like(mask), torch.zeros(len(batch)))
        if step == 1 and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.train()
        opt.zero_grad(set_to_none=True)
        accumulate(model, sb, list(range(len(batch))), algo.micro_batch, scoring, sft.loss, sharded=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
            tokens.append(sum(len(t.token_ids) for t in batch))
    step_s = statistics.median(times)
    tok_s = statistics.median(n / s for n, s in zip(tokens, times))
    mfu = 6 * n_params * tok_s / PEAK_BF16
    print(f"train: {args.seqs} conversations x {args.turns} turns ({statistics.median(tokens):.0f} tokens, longest "
          f"{longest}), micro-batch {args.micro_batch}; step {step_s:.2f} s; {tok_s:,.0f} trained tokens/s; MFU "
          f"{mfu:.1%} (6ND / 989 TFLOP/s)", flush=True)
    plan = plan_for(layers)
    update = {k: plan["phases"][k] for k in ("train", "optimizer")}
    for line in memory.format_plan({"phases": update, "totals": {k: plan["totals"][k] for k in update},
                                    "peak_phase": max(update, key=lambda k: plan["totals"][k]),
                                    "peak": update_peak(plan)}):
        print("plan" + line, flush=True)
    ok = True
    # ---- packing under this device's attention kernel: a packed micro-batch scores every trajectory as it is
    # scored alone in a padded row (trajectories that attended to each other would be off by O(1))
    model.eval()
    rows = data[:args.seqs]
    with torch.no_grad():
        padded = logprobs(model, rows, list(range(len(rows))), scoring)
        packed = logprobs(model, rows, list(range(len(rows))), replace(scoring, packing=True))
    on = torch.zeros_like(padded, dtype=torch.bool)
    for r, t in enumerate(rows):
        on[r, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.bool)
    gap = float((padded - packed).abs()[on].max())
    ok_pack = gap < PACKED_GAP
    ok = ok and ok_pack
    layout = "one row" if packs_into_one_row(model) else "rows"
    print(f"packing: {len(rows)} conversations in one packed micro-batch ({layout}, "
          f"{model.config.text_config._attn_implementation}) against padded rows: max |logprob gap| {gap:.2e} "
          f"over {int(on.sum())} trained tokens{'' if ok_pack else f'  MISMATCH: above {PACKED_GAP}'}", flush=True)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        ratio = peak / update_peak(plan)
        ok = 0.85 <= ratio <= 1.15
        print(f"memory: measured peak {peak / 2**30:.2f} GiB (torch.cuda.max_memory_allocated), plan "
              f"{update_peak(plan) / 2**30:.2f} GiB, measured/plan {ratio:.2f}"
              f"{'' if ok else '  MISMATCH: outside 0.85-1.15'}", flush=True)
    # ---- a checkpoint of this model as a run writes it (DCP masters and moments, the bf16 export, the manifest's
    # hashing), and the resume search's verification, when the disk has room for it three times over
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    ckpt_bytes = 14 * n_params  # fp32 masters 4 + AdamW moments 8 + bf16 export 2 bytes a parameter
    free = shutil.disk_usage(run_dir).free
    save_s = verify_s = float("nan")
    if free >= 3 * ckpt_bytes:
        t0 = time.perf_counter()
        ckpt = ckpt_io.save_checkpoint(run_dir, 1, model, processor, opt, export_dtype=compute)
        save_s = time.perf_counter() - t0
        written = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        t0 = time.perf_counter()
        found = ckpt_io.find_resume_point(run_dir)
        verify_s = time.perf_counter() - t0
        ok = ok and found == ckpt
        print(f"checkpoint: {written / 2**30:.1f} GiB written, fsynced and hashed in {save_s:.1f} s "
              f"({written / 2**30 / save_s:.2f} GiB/s); verified for resume in {verify_s:.1f} s"
              f"{'' if found == ckpt else '  FAILED: the resume search did not find it'}", flush=True)
    else:
        print(f"checkpoint: skipped ({ckpt_bytes / 2**30:.0f} GiB would need 3x the {free / 2**30:.0f} GiB free)",
              flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"gpu_check layers={layers} attention={model.config.text_config._attn_implementation} step_s={step_s:.3f} "
          f"train_tokens_per_s={tok_s:.0f} mfu={mfu:.4f} packed_gap={gap:.2e} checkpoint_s={save_s:.1f} "
          f"verify_s={verify_s:.1f}", flush=True)
    torch.distributed.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
