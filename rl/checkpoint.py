"""Atomic, verifiable checkpoints: ``<run dir>/checkpoints/step_<N>/``, one code path for 1 process, DDP and FSDP2.

Layout of one checkpoint:
    dcp/               torch.distributed.checkpoint: the fp32 master weights and the AdamW moments, each rank
                       writing its own shards (``__<rank>_0.distcp``) and rank 0 the ``.metadata``; loads back
                       into any world size (DCP reshards)
    policy/            save_pretrained (safetensors, in model.dtype) + processor: loadable by transformers,
                       evaluate.py and vLLM (gathered to rank 0, which writes it)
    rng/rank_<r>.json  each rank's python, numpy, torch (and CUDA) generator states
    trainer_state.pt   scheduler, step, sampler position, world size (weights_only-safe)
    metrics.json       anything the loop wants back on resume (e.g. the last eval score)
    manifest.json      sha256 and size of every file above; written last, by rank 0

Every rank writes into ``.tmp_step_<N>``; after a barrier each rank fsyncs and hashes its share of the files (about
equal bytes: the DCP shards, the export's 2 GB shards), rank 0 writes the manifest, fsyncs and renames the dir into
place, so a crash never leaves a half-written ``step_<N>``. Verifying spreads the hashing the same way; a corrupt
checkpoint is reported in one line and the previous good one is used.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from conf.recorded import RUN_CONFIG
from models.distributed import full_state_dict
from models.tiny import save_processor
from rl import dist as D
from rl import faults

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dirs(root: Path) -> None:
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's files of ``sizes`` (name -> bytes), so that every rank hashes about the same number of bytes:
    largest first, each to the rank with the fewest bytes so far. Every rank computes the same split."""
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def _hash_share(root: Path, sizes: dict[str, int], fsync: bool) -> dict[str, dict]:
    """sha256 and size of every file of ``sizes`` (rank 0's listing: name -> bytes, the same on every rank), each
    rank hashing its ``share`` (fsynced first when ``fsync``), gathered into one dict (a collective). A file a rank
    cannot read, or sees at another size (a shared filesystem not yet consistent), fails the save on every rank in
    one line, instead of leaving the others waiting or the file out of the manifest."""
    mine, problems = {}, []
    for n in share(sizes, D.rank(), D.world_size()):
        try:
            if (root / n).stat().st_size != sizes[n]:
                raise OSError(f"{(root / n).stat().st_size} bytes here, {sizes[n]} listed by rank 0")
            if fsync:
                _fsync_file(root / n)
            mine[n] = {"sha256": _sha256(root / n), "bytes": sizes[n]}
        except OSError as err:
            problems.append(f"rank {D.rank()}: {n}: {err}")
    merged, found = {}, []
    for part, errs in D.all_gather_objects((mine, problems)):
        merged.update(part)
        found += errs
    if found or set(merged) != set(sizes):
        raise RuntimeError(f"checkpoint {root.name} not written: " + ("; ".join(found) or "files left unhashed"))
    return {n: merged[n] for n in sorted(merged)}


def rng_state() -> dict:
    """This process's generator states (JSON-safe)."""
    np_state = np.random.get_state()
    state = {"python": repr(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(ast.literal_eval(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _dcp(fn, state: dict, path: Path) -> None:
    """``dcp.save``/``dcp.load`` (one process: without a group, as DCP itself assumes, minus its warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        fn(state, checkpoint_id=str(path))


def _sharded_state(policy, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _set_config_dtype(path: Path, dtype: str) -> None:
    """Write ``dtype`` into an exported config.json and its sub-configs (``save_pretrained`` writes the dtype of
    the module's parameters: the fp32 masters, over weights exported in the compute dtype)."""
    config = json.loads(path.read_text())
    for part in (config, *(v for v in config.values() if isinstance(v, dict) and "dtype" in v)):
        if "dtype" in part:
            part["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(run_dir: str | Path, step: int, policy, processor, optimizer=None, scheduler=None, sampler=None,
                    metrics: dict | None = None, keep_last: int = 0, export_dtype: torch.dtype | None = None,
                    config: dict | None = None) -> Path:
    """Write ``checkpoints/step_<step>`` atomically (every rank calls it: a collective); prune to the newest
    ``keep_last`` (0 = keep all). Without ``optimizer`` only the HF export and RNG are written (an export).
    ``config`` (the run's resolved config) is written to ``policy/vlmaze_config.yaml``: evaluate.py reads the
    environment and model settings the policy was trained with from it."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    if D.is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    D.barrier()
    if optimizer is not None:
        _dcp(dcp.save, _sharded_state(policy, optimizer), tmp / "dcp")
    (tmp / "rng" / f"rank_{D.rank()}.json").write_text(json.dumps(rng_state()))
    # gathered when sharded (FSDP2, one rank included: cluster=1gpu) or replicated over ranks (DDP: rank 0's copy)
    gather = D.is_sharded(policy) or D.world_size() > 1
    export = full_state_dict(policy, cpu_offload=True) if gather else policy.state_dict()
    if D.is_main():
        if export_dtype is not None:
            export = {k: v.to(export_dtype) if v.is_floating_point() else v for k, v in export.items()}
        # shards of at most 2 GB, so the hashing below spreads over the ranks (16 GB in one file would be one rank's)
        policy.save_pretrained(tmp / "policy", safe_serialization=True, state_dict=export, max_shard_size="2GB")
        if export_dtype is not None:  # config.json names the exported weights' dtype, not the fp32 masters'
            _set_config_dtype(tmp / "policy" / "config.json", str(export_dtype).removeprefix("torch."))
        save_processor(processor, tmp / "policy")  # a full Qwen3VLProcessor: vLLM loads it
        if config is not None:
            OmegaConf.save(OmegaConf.create(config), tmp / "policy" / RUN_CONFIG)
        state = {"step": step, "world_size": D.world_size()}
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        if sampler is not None:
            state["sampler"] = sampler.state_dict()
        if faults.active("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)  # half-written: policy/ and dcp/ exist, the rest does not
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "metrics.json").write_text(json.dumps(metrics or {}))
    del export
    D.barrier()
    # every rank fsyncs and hashes its share of the files (by bytes: the DCP shards, the export's shards), rank 0
    # lists them and writes the manifest; a checkpoint's cost is spread, not one rank's while the others wait
    sizes = D.broadcast_object({str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*"))
                                if p.is_file()} if D.is_main() else None)
    files = _hash_share(tmp, sizes, fsync=True)
    if D.is_main():
        (tmp / "manifest.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync_file(tmp / "manifest.json")
        _fsync_dirs(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return final


def load_checkpoint(ckpt: Path, policy, optimizer) -> dict:
    """Load a checkpoint into the (possibly sharded) ``policy`` and ``optimizer`` and this rank's RNG; returns
    the trainer state (step, scheduler, sampler, metrics). Every rank calls it (a collective)."""
    state = load_trainer_state(ckpt)
    if (ckpt / "dcp").is_dir():
        sd = _sharded_state(policy, optimizer)
        _dcp(dcp.load, sd, ckpt / "dcp")
        set_state_dict(policy, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        log.warning("%s holds no dcp/ (an export, or written before sharded checkpoints): weights from its "
                    "policy/, AdamW moments restart from zero", ckpt)
    saved_world = int(state.get("world_size", 1))
    rng_file = ckpt / "rng" / f"rank_{D.rank()}.json"
    if saved_world != D.world_size():
        log.warning("%s was written by %d rank(s), this run has %d: weights and optimizer reshard exactly, the "
                    "random streams restart from the seed", ckpt, saved_world, D.world_size())
    elif rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    return state


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint dirs, oldest first (by step)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify(ckpt: Path, rank: int = 0, world: int = 1) -> str | None:
    """None if the checkpoint matches its manifest, else the reason it does not. Every file's presence and size
    is checked; with ``world`` > 1 only this ``rank``'s ``share`` of them is hashed."""
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
    mine = share({rel: meta["bytes"] for rel, meta in manifest["files"].items()}, rank, world)
    for rel in sorted(mine):
        if _sha256(ckpt / rel) != manifest["files"][rel]["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def find_resume_point(run_dir: str | Path) -> Path | None:
    """Newest checkpoint that verifies, each rank hashing its share of it (a collective under torchrun: every rank
    calls it); each corrupt newer one is reported in one line."""
    found = D.broadcast_object([str(p) for p in list_checkpoints(run_dir)] if D.is_main() else None)
    for ckpt in map(Path, reversed(found)):
        problems = [p for p in D.all_gather_objects(verify(ckpt, D.rank(), D.world_size())) if p]
        if not problems:
            return ckpt
        if D.is_main():
            log.warning("skipping corrupt checkpoint %s: %s", ckpt, problems[0])
    return None


def load_trainer_state(ckpt: Path) -> dict:
    """Scheduler/sampler/step state and metrics (weights_only: no pickled code is executed)."""
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["metrics"] = json.loads((ckpt / "metrics.json").read_text())
    return state

