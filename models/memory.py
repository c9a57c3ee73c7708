"""The per-GPU memory plan of a training run: what train.py keeps, component by component.

Parameter counts come from the architecture itself, built on the meta device (no weights, no download):
the FSDP2 units train.py shards (the root's own parameters: embeddings, final norm, lm_head; the vision
tower; each decoder layer) and the largest single tensor (what one streamed weight-sync gather holds).

What the code keeps, per GPU (N parameters, W ranks, c bytes of the compute dtype, U the largest unit):
  training phase (the engine asleep or a resident hf copy)
    fp32 master shards 4N/W, fp32 gradient shards 4N/W, AdamW moments 8N/W       (FSDP2 MixedPrecisionPolicy)
    unsharded compute-dtype units in flight: the root (kept from forward to backward) + 2U (current + prefetch)
    their gradients: the root's c x root live through the whole backward; one unit at a time c x U + its fp32
      reduce-scatter buffer 4 x U
    the reference (algo.kl_coef > 0): c N/W, sharded like the policy (its units are gathered only in no-grad
      forwards, before the policy's backward, so they do not add to the peak)
    the hf engine's unsharded copy under FSDP2: c N; with vLLM no copy (level-2 sleep frees its weights and KV)
    activations: with gradient checkpointing each decoder layer keeps its input (tokens x H x c) and one layer
      is recomputed at a time (tokens x (8H + 3I) x c); without, every layer keeps (8H + 3I) per token
    the log-prob head: one chunk of models.forward.chunk_positions(V) positions x V, recomputed in backward
      (models.forward._chunk_logprob_entropy): the compute-dtype projection, then fp32 tensors alive together at
      its peak: the logits (kept by logsumexp), the probabilities (kept by softmax), the masked logits and their
      product (kept by the multiply), and in backward three fp32 gradients of the same shape: 7 x 4 + c bytes
  optimizer step (after backward: activations, in-flight units and the head's chunk are freed)
    masters, gradients and moments (16N/W) + torch's foreach AdamW temporary: the square root of every second
    moment at once (torch/optim/adam.py, _multi_tensor_adam: _foreach_sqrt(exp_avg_sqs), 4N/W) + the
    reference shard and the hf copy where present
  rollout phase
    the trainer's masters and moments stay (12N/W; gradients are freed after the update), the reference shard,
    and vLLM's gpu_memory_utilization x GPU (its weights, KV cache and activations live inside that budget)
    or the hf copy (its KV cache grows with the batch: not modelled)
  weight sync and checkpoint: masters + moments + reference + vLLM's budget (awake) + one gathered tensor (the
    largest, in fp32: a checkpoint's export gathers the fp32 masters one tensor at a time; the weight sync the
    compute dtype)
The plan's figure is the largest phase. Tokens per micro-batch are an upper bound: every row padded to an
episode of the full turn budget with every response at max_new_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maze.env import training_sizes, turn_budget
from models.forward import chunk_positions

GIB = 1024**3
PROMPT_TOKENS = 400  # system prompt + first user turn, text only (an upper estimate for both interfaces)
TURN_TEXT_TOKENS = 40  # per turn: chat markup, feedback line, vision start/end

# Qwen3-VL-{2B,4B,8B}-Instruct: text and vision towers (config.json of each hub checkpoint)
ARCH = {
    "qwen3_vl_2b": (dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
                    dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                         deepstack_visual_indexes=[5, 11, 17])),
    "qwen3_vl_4b": (dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
                    dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                         deepstack_visual_indexes=[5, 11, 17])),
    "qwen3_vl_8b": (dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
                    dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                         deepstack_visual_indexes=[8, 16, 24])),
}


def arch_config(name: str, layers: int | None = None, token_ids: dict | None = None):
    """The ``Qwen3VLConfig`` of ``name`` (optionally with ``layers`` decoder layers), built offline."""
    # transformers only where a plan is built (config validation imports this module)
    from transformers import Qwen3VLConfig

    text, vision = (dict(d) for d in ARCH[name])
    text.update(max_position_embeddings=262144, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    if layers is not None:
        text["num_hidden_layers"] = layers
    vision.update(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                  hidden_act="gelu_pytorch_tanh")
    ids = token_ids or {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                        "vision_end_token_id": 151653}
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                         **ids)


@dataclass
class Units:
    """Parameter counts of the FSDP2 units of a Qwen3-VL model."""

    total: int
    root: int  # the root unit's own parameters: embeddings, final norm, lm_head
    vision: int
    layer: int  # one decoder layer
    layers: int
    largest_tensor: int
    hidden: int
    intermediate: int
    vocab: int
    kv_per_token: int = 0  # KV-cache elements a token holds: 2 (K and V) x layers x KV heads x head dim

    @property
    def largest_unit(self) -> int:
        return max(self.vision, self.layer)


def count_units(config) -> Units:
    """Build ``config`` on the meta device and count each unit's parameters."""
    # transformers' model classes take seconds to import: only where a model is built
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    params = dict(model.named_parameters())  # tied weights appear once
    total = sum(p.numel() for p in params.values())
    vision = sum(p.numel() for n, p in params.items() if n.startswith("model.visual."))
    layers = model.model.language_model.layers
    layer = max(sum(p.numel() for p in m.parameters()) for m in layers) if len(layers) else 0
    text = config.text_config
    return Units(total=total, root=total - vision - layer * len(layers), vision=vision, layer=layer,
                 layers=len(layers), largest_tensor=max(p.numel() for p in params.values()),
                 hidden=text.hidden_size, intermediate=text.intermediate_size, vocab=text.vocab_size,
                 kv_per_token=2 * len(layers) * text.num_key_value_heads
                 * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads))


def image_tokens(cfg_env, cfg_model) -> int:
    """Vision tokens of one frame: the rendered side, resized by the processor to 32 px multiples in its pixel
    bounds, one token per 32 x 32 px (patch 16, merge 2)."""
    size, ppc = cfg_env.size, cfg_env.pixels_per_cell
    side = (2 * size - 1) * ppc if cfg_env.view == "egocentric" else size * ppc + cfg_env.pad_before
    side = math.ceil(side / max(cfg_env.pad_to, 1)) * max(cfg_env.pad_to, 1)
    area = min(max(side * side, cfg_model.min_pixels), cfg_model.max_pixels)
    return max(1, round(math.sqrt(area) / 32)) ** 2


def sequence_tokens(cfg) -> int:
    """Upper bound of one episode's tokens: the turn budget at the largest training size, every response at
    max_new_tokens."""
    sizes = training_sizes(cfg.env)
    turns = max(turn_budget(s, cfg.env.max_turns, cfg.env.size) for s in sizes)
    per_turn = image_tokens(cfg.env, cfg.model) + TURN_TEXT_TOKENS + cfg.algo.max_new_tokens
    return PROMPT_TOKENS + turns * per_turn


def plan(u: Units, *, world: int, compute_bytes: int, engine: str, kl: bool, tokens: int,
         grad_ckpt: bool, gpu_gib: float = 0.0, gpu_util: float = 0.0, fsdp: bool = True) -> dict:
    """Bytes per GPU by component and phase; ``peak`` is the largest phase. ``tokens``: per micro-batch."""
    c, n, w = compute_bytes, u.total, (world if fsdp else 1)
    h, i = u.hidden, u.intermediate
    masters, grads, moments = 4 * n / w, 4 * n / w, 8 * n / w
    if fsdp:
        in_flight = c * (u.root + 2 * u.largest_unit)
        # the root's gradients live through the whole backward (lm_head first, embeddings last); one unit at a
        # time is reduce-scattered through an fp32 buffer
        unit_grads = c * u.root + (c + 4) * u.largest_unit
    else:  # one process / DDP: full fp32 weights; autocast casts each weight as an op uses it
        in_flight = c * u.largest_tensor if c < 4 else 0.0
        unit_grads = 0.0
    reference = c * n / w if kl else 0.0
    hf_copy = c * n if engine == "hf" and fsdp and world >= 1 else 0.0
    per_layer = tokens * (8 * h + 3 * i) * c
    activations = (u.layers * tokens * h * c + per_layer) if grad_ckpt else u.layers * per_layer
    logits = min(chunk_positions(u.vocab), tokens) * u.vocab * (7 * 4 + c)
    vllm = gpu_util * gpu_gib * GIB if engine == "vllm" else 0.0
    train = {"fp32 master shards": masters, "fp32 gradient shards": grads, "AdamW moments (fp32)": moments,
             "unsharded units in flight": in_flight, "unit gradients and fp32 reduce buffers": unit_grads,
             "reference shard": reference, "hf engine copy": hf_copy, "activations": activations,
             "log-prob head chunk": logits}
    optimizer = {"fp32 master shards": masters, "fp32 gradient shards": grads, "AdamW moments (fp32)": moments,
                 "foreach AdamW temporary (fp32)": 4 * n / w, "reference shard": reference, "hf engine copy": hf_copy}
    rollout = {"fp32 master shards": masters, "AdamW moments (fp32)": moments, "reference shard": reference,
               "hf engine copy": hf_copy, "vLLM budget (weights, KV cache)": vllm}
    sync = {"fp32 master shards": masters, "AdamW moments (fp32)": moments, "reference shard": reference,
            "vLLM budget (weights, KV cache)": vllm, "hf engine copy": hf_copy,
            "one gathered tensor": 4 * u.largest_tensor}
    phases = {"train": train, "optimizer": optimizer, "rollout": rollout, "sync": sync}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak = max(totals, key=totals.get)
    return {"phases": phases, "totals": totals, "peak_phase": peak, "peak": totals[peak]}


ENGINE_HEADROOM_GIB = 4.0  # what vLLM's budget must leave besides the trainer: the CUDA context, NCCL's buffers,
# vLLM's CUDA-graph pool (kept through sleep) and the caching allocator's slack
ENGINE_OVERHEAD_GIB = 3.0  # inside vLLM's budget besides weights and KV cache: its profiled activation peak (a
# 16,384-token prefill, the sampler, the vision encoder) and CUDA graphs (an estimate: vLLM logs the real figure)
MAX_ENGINE_FRACTION = 0.9


def engine_fraction(p: dict, gpu_gib: float) -> float:
    """The largest ``gpu_memory_utilization`` the trainer leaves free while the engine runs: the GPU less the
    rollout and sync phases' trainer bytes (``p`` planned with no vLLM budget) and ``ENGINE_HEADROOM_GIB``, in
    hundredths, at most ``MAX_ENGINE_FRACTION``. vLLM checks at start that this fraction of the GPU is free,
    and its wake-up after a sleep maps the same bytes again without checking."""
    if gpu_gib <= 0:
        return 0.0
    trainer = max(sum(v for k, v in p["phases"][phase].items() if not k.startswith("vLLM"))
                  for phase in ("rollout", "sync"))
    free = gpu_gib * GIB - trainer - ENGINE_HEADROOM_GIB * GIB
    return max(0.0, min(MAX_ENGINE_FRACTION, math.floor(100 * free / (gpu_gib * GIB)) / 100))


def kv_cache_tokens(u: Units, compute_bytes: int, gpu_gib: float, gpu_util: float) -> int:
    """Tokens vLLM's KV cache holds in its budget: the budget less the weights and ``ENGINE_OVERHEAD_GIB``."""
    kv = gpu_util * gpu_gib * GIB - compute_bytes * u.total - ENGINE_OVERHEAD_GIB * GIB
    return max(0, int(kv // (compute_bytes * max(u.kv_per_token, 1))))


def format_plan(p: dict) -> list[str]:
    lines = []
    for phase, parts in p["phases"].items():
        shown = " + ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
        lines.append(f"  {phase:9s} {shown} = {p['totals'][phase] / GIB:.2f} GiB")
    lines.append(f"  peak: {p['peak_phase']} phase, {p['peak'] / GIB:.2f} GiB per GPU")
    return lines
