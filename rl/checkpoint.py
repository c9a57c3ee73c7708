"""Atomic, verifiable checkpoints: ``<run dir>/checkpoints/step_<N>/``.

Layout of one checkpoint:
    policy/            save_pretrained (safetensors) + processor: loadable by transformers and vLLM
    trainer_state.pt   optimizer, scheduler, step, sampler position, torch RNG (weights_only-safe)
    rng.json           python and numpy RNG states
    metrics.json       anything the loop wants back on resume (e.g. TensorBoard step)
    manifest.json      sha256 and size of every file above; written last

It is written to ``.tmp_step_<N>`` and renamed into place after an fsync, so a crash never leaves
a half-written ``step_<N>``. Loading verifies the manifest; a corrupt checkpoint is reported in one
line and the previous good one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from rl import faults

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": repr(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}


def set_rng_state(state: dict, torch_state: torch.Tensor | None) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    if torch_state is not None:
        torch.set_rng_state(torch_state)


def save_checkpoint(run_dir: str | Path, step: int, model, processor, optimizer_state: dict | None = None,
                    scheduler=None, sampler=None, metrics: dict | None = None, keep_last: int = 0,
                    model_state: dict | None = None) -> Path:
    """Write ``checkpoints/step_<step>`` atomically; prune to the newest ``keep_last`` (0 = keep all).

    ``model_state``: a full state dict to save instead of ``model.state_dict()`` (FSDP2 gathers one).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "policy", safe_serialization=True, state_dict=model_state)
    from models.tiny import save_processor

    save_processor(processor, tmp / "policy")  # a full Qwen3VLProcessor: vLLM loads it
    state = {"step": step, "torch_rng": torch.get_rng_state()}
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if faults.active("kill_in_save", step):
        os.kill(os.getpid(), signal.SIGKILL)  # half-written: policy/ exists, the rest does not
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "rng.json").write_text(json.dumps(rng_state()))
    (tmp / "metrics.json").write_text(json.dumps(metrics or {}))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
                                        for p in files}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint dirs, oldest first (by step)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify(ckpt: Path) -> str | None:
    """None if the checkpoint matches its manifest, else the reason it does not."""
    manifest_path = ckpt / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest.json (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    for rel, meta in manifest["files"].items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != meta["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['bytes']}"
        if _sha256(p) != meta["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def latest_valid(run_dir: str | Path) -> Path | None:
    """Newest checkpoint that verifies; each corrupt newer one is reported in one line."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        log.warning("skipping corrupt checkpoint %s: %s", ckpt, problem)
    return None


def load_trainer_state(ckpt: Path) -> dict:
    """Optimizer/scheduler/sampler/RNG state (weights_only: no pickled code is executed)."""
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["rng"] = json.loads((ckpt / "rng.json").read_text())
    state["metrics"] = json.loads((ckpt / "metrics.json").read_text())
    return state
