"""Build or load the policy VLM and its processor from ``conf/model``."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_SFT = REPO_ROOT / "checkpoints" / "tiny_sft"  # the committed tiny SFT warm start (see README)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(path: str | None) -> str | None:
    """A relative local path is looked up from the working dir, then from the repo root."""
    if path is None:
        return None
    p = Path(path)
    if p.exists() or p.is_absolute():
        return str(p)
    if (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    return path  # a hub id


def attn_implementation(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_policy(cfg_model, device: str = "cpu"):
    """Return ``(model, processor)`` for ``conf/model``; weights only from safetensors."""
    from transformers import AutoModelForImageTextToText

    from models.tiny import load_processor

    path = resolve_path(cfg_model.path)
    if cfg_model.name == "tiny" and path is None:
        from models.tiny import build_tiny

        model, processor = build_tiny(cfg_model.init_seed, cfg_model.min_pixels, cfg_model.max_pixels,
                                      cfg_model.tiny_layers, cfg_model.tiny_hidden, cfg_model.tiny_vision_depth,
                                      cfg_model.tiny_vision_hidden)
        log.info("model: tiny Qwen3-VL, random init (seed %d), %d params", cfg_model.init_seed,
                 sum(p.numel() for p in model.parameters()))
        return model.to(device), processor
    if cfg_model.name == "tiny" and not Path(path).is_dir():
        raise FileNotFoundError(f"model.path={cfg_model.path!r} is not a directory")
    attn = attn_implementation(cfg_model.attn_implementation, device)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=DTYPES[cfg_model.dtype], attn_implementation=attn, use_safetensors=True,
        trust_remote_code=cfg_model.trust_remote_code)
    processor = load_processor(path, min_pixels=cfg_model.min_pixels, max_pixels=cfg_model.max_pixels)
    log.info("model: %s from %s, dtype %s, attn_implementation=%s, %d params", cfg_model.name, path,
             cfg_model.dtype, attn, sum(p.numel() for p in model.parameters()))
    return model.to(device), processor


def load_policy_dir(path: str | Path, dtype: str = "float32"):
    """``(model, processor)`` from a saved HF directory (a checkpoint's policy/ or the shipped SFT start)."""
    from transformers import AutoModelForImageTextToText

    from models.tiny import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=DTYPES[dtype], use_safetensors=True)
    return model.eval(), load_processor(path)
