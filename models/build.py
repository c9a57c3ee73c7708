"""Build or load the policy VLM and its processor from ``conf/model``."""

from __future__ import annotations

import hashlib
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


def weights_sha256(path: str | Path) -> str | None:
    """One sha256 over a saved policy's weight files (``*.safetensors``, by name, then content; a vlmaze checkpoint
    dir's are in its ``policy/``): which weights a report was made from, whatever path they were read through.
    ``None`` for a hub id or a dir without them."""
    path = Path(path) / "policy" if (Path(path) / "policy").is_dir() else Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


FLASH_DTYPES = ("bfloat16", "float16")  # flash-attention kernels take no fp32


def flash_attention_usable() -> bool:
    """transformers' own check (package, version, a CUDA torch), then an import: an installed wheel built for
    another torch fails here (an undefined symbol), not at the first forward."""
    # transformers only where a model is built (config validation imports this module)
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return False
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # ImportError, OSError: an ABI-broken build
        log.warning("flash_attn is installed but does not import (%s: %s); using sdpa", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


def attn_implementation(requested: str, device: str, dtype: str, flash_usable=flash_attention_usable) -> str:
    """``auto``: flash-attention 2 on CUDA for a bf16/fp16 model when it is usable, else torch's SDPA (which on
    CUDA picks its own flash / memory-efficient / math backend per call). An explicit choice is kept
    (``conf.schema.validate`` refuses flash_attention_2 with float32)."""
    if requested != "auto":
        return requested
    if device == "cuda" and dtype in FLASH_DTYPES and flash_usable():
        return "flash_attention_2"
    return "sdpa"


def load_policy(cfg_model, device: str = "cpu"):
    """Return ``(model, processor)`` for ``conf/model``; weights only from safetensors."""
    # transformers' model classes take seconds to import: only where a model is built
    from transformers import AutoModelForImageTextToText

    from models.tiny import load_processor

    path = resolve_path(cfg_model.path)
    if cfg_model.name == "tiny" and path is None:
        from models.tiny import build_tiny  # (the same: transformers)

        model, processor = build_tiny(cfg_model.init_seed, cfg_model.min_pixels, cfg_model.max_pixels,
                                      cfg_model.tiny_layers, cfg_model.tiny_hidden, cfg_model.tiny_vision_depth,
                                      cfg_model.tiny_vision_hidden)
        log.info("model: tiny Qwen3-VL, random init (seed %d), %d params", cfg_model.init_seed,
                 sum(p.numel() for p in model.parameters()))
        return model.to(device), processor
    if cfg_model.name == "tiny" and not Path(path).is_dir():
        raise FileNotFoundError(f"model.path={cfg_model.path!r} is not a directory")
    attn = attn_implementation(cfg_model.attn_implementation, device, cfg_model.dtype)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=DTYPES[cfg_model.dtype], attn_implementation=attn, use_safetensors=True,
        trust_remote_code=cfg_model.trust_remote_code)
    processor = load_processor(path, min_pixels=cfg_model.min_pixels, max_pixels=cfg_model.max_pixels)
    kernel = attn
    if attn == "sdpa" and device == "cuda":
        b = torch.backends.cuda
        kernel += (f" (torch picks per call among flash={b.flash_sdp_enabled()}, "
                   f"efficient={b.mem_efficient_sdp_enabled()}, math={b.math_sdp_enabled()})")
    log.info("model: %s from %s, dtype %s, attn_implementation=%s, %d params", cfg_model.name, path,
             cfg_model.dtype, kernel, sum(p.numel() for p in model.parameters()))
    return model.to(device), processor


def load_policy_dir(path: str | Path, dtype: str = "float32"):
    """``(model, processor)`` from a saved HF directory (a checkpoint's policy/ or the shipped SFT start)."""
    # transformers' model classes take seconds to import: only where a model is built
    from transformers import AutoModelForImageTextToText

    from models.tiny import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=DTYPES[dtype], use_safetensors=True)
    return model.eval(), load_processor(path)
