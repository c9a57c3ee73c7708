"""Under torchrun (gloo): ranks and process group as a run starts them (``rl.run.start_ranks``), then the FSDP2
policy and AdamW a run builds, one ``save_checkpoint`` and the resume search (``find_resume_point``), with the
files each rank hashed recorded. Each rank writes ``<out>/rank<r>.json``: the files it hashed while saving and while
verifying, the manifest's files and sizes, the process group's timeout as ``init_process_group`` got it, the
checkpoint the resume search chose, and ``check_in_sync``'s checksum with the parameters it gathered for it.

    torchrun --standalone --nproc-per-node 2 tests/scripts/checkpoint_ranks.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from conf.schema import register  # noqa: E402
from rl import checkpoint as ckpt_io  # noqa: E402
from rl import dist as D  # noqa: E402
from rl.run import build_models, start_ranks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=cpu2", "cluster.parallel=fsdp2",
                                                        "cluster.collective_timeout_min=7"])
    seen = {}
    real_init = dist.init_process_group

    def init_spy(*a, **kw):
        seen["timeout_s"] = kw["timeout"].total_seconds() if "timeout" in kw else None
        return real_init(*a, **kw)

    dist.init_process_group = init_spy
    start_ranks(cfg)
    policy, processor, *_ = build_models(cfg, None, "cpu", fsdp=True, with_reference=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()  # AdamW's moments exist: the DCP shards hold them

    gathers = []  # check_in_sync under FSDP2: no parameter gathered, the same fingerprint as the gathered weights
    real_full = DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **kw: gathers.append(1) or real_full(self, *a, **kw)
    checksum = D.check_in_sync(policy)
    DTensor.full_tensor = real_full
    gathered = sum(float(p.full_tensor().double().flatten().mul(1.0 + 1e-3 * (k % 97)).sum())
                   for k, p in enumerate(policy.parameters()))

    hashed = []
    real_sha = ckpt_io._sha256
    ckpt_io._sha256 = lambda p: hashed.append(str(p)) or real_sha(p)
    ckpt = ckpt_io.save_checkpoint(out / "run", 1, policy, processor, optimizer, metrics={})
    saving = [str(Path(p).relative_to(out / "run/checkpoints/.tmp_step_1")) for p in hashed]
    hashed.clear()
    chosen = ckpt_io.find_resume_point(out / "run")
    verifying = [str(Path(p).relative_to(ckpt)) for p in hashed]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (out / f"rank{D.rank()}.json").write_text(json.dumps({
        "gathers": len(gathers), "checksum": checksum, "gathered_checksum": gathered,
        "saving": saving, "verifying": verifying, "timeout_s": seen.get("timeout_s"), "chosen": str(chosen),
        "files": {k: v["bytes"] for k, v in manifest["files"].items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
