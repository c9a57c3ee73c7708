"""torchrun, 2 gloo processes: DDP and FSDP2 train, stay in sync, checkpoint (DCP shards + HF export), resume
exactly after a SIGKILL, survive uneven work, reduce in fp32 under bf16 compute, and run under submitit."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("parallel,port", [("ddp", 29521), ("fsdp2", 29522)])
def test_two_rank_training_ends_with_equal_weights(tmp_path, parallel, port):
    args = ["cluster=cpu2", f"cluster.parallel={parallel}", f"cluster.rdzv_endpoint=localhost:{port}",
            "reward=shaped", "algo.entropy_coef=0.05", "algo.lr=0.01", "algo.mazes_per_step=2", "algo.group_size=2",
            "env.max_turns=3", "algo.max_new_tokens=8", "trainer.eval_every=2", "trainer.eval_suites=[size7]",
            "trainer.eval_at_start=false", "trainer.steps=2", "trainer.save_every=1", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = [float(x) for x in re.findall(r"ranks in sync at step \d+: parameter checksum ([-\d.]+)", proc.stdout)]
    assert len(sums) == 2 and sums[0] != sums[1], proc.stdout[-2000:]  # in sync, and training moved the weights
    assert "eval step 2: size7" in proc.stdout

    from transformers import AutoModelForImageTextToText

    import models.tiny  # noqa: F401

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "checkpoints/step_2/policy")
    from rl.dist import params_checksum

    assert abs(params_checksum(model) - sums[1]) < 1e-6 * abs(sums[1])

    # the eval ran sharded over the 2 ranks; one process on the saved checkpoint writes the same episodes
    import json

    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), f"checkpoint={tmp_path}/checkpoints/step_2",
                           "suites=[size7]", "figures=false", "env.max_turns=3", "algo.max_new_tokens=8",
                           f"hydra.run.dir={tmp_path}/single"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads((tmp_path / "eval/step_2/report.json").read_text())
    single = json.loads((tmp_path / "single/report.json").read_text())
    assert sharded["suites"]["size7"]["n"] == single["suites"]["size7"]["n"] == 32
    keys = ("maze_hash", "success", "path", "failure", "turns")
    assert [[e[k] for k in keys] for e in sharded["episodes"]] == [[e[k] for k in keys] for e in single["episodes"]]


# ---------------------------------------------------------------- the GPU path's defects, shown on gloo

TINY = ["reward=shaped", "algo.entropy_coef=0.05", "algo.lr=0.01", "algo.mazes_per_step=2", "algo.group_size=2",
        "env.max_turns=3", "algo.max_new_tokens=8", "trainer.eval_every=0", "trainer.keep_last=0"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _fsdp_step(out, nproc, *args):
    import json

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(ROOT / "tests/scripts/fsdp_step.py"), "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_fsdp2_mixed_precision_trains_fp32_masters_at_the_reference_lr(tmp_path):
    """bf16 forward, fp32 gradient reduce-scatter, fp32 shards and AdamW: at lr 1e-6 most weights move in 3
    steps. The contrast (bf16 parameters, AdamW on them) rounds almost every update away."""
    r = _fsdp_step(tmp_path / "mixed", 2, "--dtype", "bfloat16", "--lr", "1e-6", "--steps", "3")
    assert r["forward_dtypes"] == ["torch.bfloat16"]
    assert r["reduce_dtypes"] == ["torch.float32"]
    assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"]
    assert r["changed_fraction"] > 0.5, r
    pure = _fsdp_step(tmp_path / "pure", 2, "--dtype", "bfloat16", "--lr", "1e-6", "--steps", "3", "--pure-bf16")
    assert pure["param_dtypes"] == ["torch.bfloat16"] and pure["changed_fraction"] < 0.1, pure


def test_one_step_gradient_does_not_depend_on_the_world_size(tmp_path):
    import torch

    _fsdp_step(tmp_path / "w1", 1, "--grads", "--steps", "1")
    _fsdp_step(tmp_path / "w2", 2, "--grads", "--steps", "1")
    g1, g2 = torch.load(tmp_path / "w1/grads.pt"), torch.load(tmp_path / "w2/grads.pt")
    assert g1.keys() == g2.keys()
    scale = max(float(g.abs().max()) for g in g1.values())
    assert scale > 0
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=1e-6 * scale, rtol=1e-4, msg=k)


def _full_state(ckpt):
    """A DCP checkpoint's weights and optimizer state as plain tensors (converted by DCP's own tool)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / "dcp", out)
    return torch.load(out, weights_only=False)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flatten(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in _flatten(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def _same(x, y) -> bool:
    import torch

    return x.equal(y) if isinstance(x, torch.Tensor) else x == y


def test_fsdp2_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    args = ["cluster=cpu2", "cluster.parallel=fsdp2", "trainer.steps=4", "trainer.save_every=2", *TINY]
    train = [sys.executable, str(ROOT / "train.py"), *args]
    ref = subprocess.run([*train, f"hydra.run.dir={tmp_path / 'ref'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=ENV)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "killed"
    killed = subprocess.run([*train, f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**ENV, "VLMAZE_FAULTS": "kill_last_rank@4"})
    # the kill landed mid-run: step 3 finished (unsaved), step 4 never did, step_2 is the newest checkpoint
    assert killed.returncode != 0 and "step 3/4" in killed.stdout and "step 4/4" not in killed.stdout
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2"]
    resumed = subprocess.run([*train, f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, env=ENV)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    a, b = _flatten(_full_state(tmp_path / "ref/checkpoints/step_4")), _flatten(_full_state(run / "checkpoints/step_4"))
    assert a.keys() == b.keys()
    moments = [k for k in a if k.startswith("optim.state.") and k.endswith("exp_avg_sq")]
    assert len(moments) == sum(1 for k in a if k.startswith("model."))  # AdamW state for every parameter
    assert all(float(a[k].abs().sum()) > 0 for k in moments)
    assert all(_same(a[k], b[k]) for k in a), [k for k in a if not _same(a[k], b[k])][:5]


def test_dapo_under_fsdp2_with_ranks_keeping_different_numbers_of_groups(tmp_path):
    """The last rank's groups all lose their variance at step 1 (a fault that zeroes its rewards): it keeps
    none, rank 0 keeps its groups, and the step still completes (zero-weight micro-batches on the short rank).
    In bf16 compute on fp32 masters, as on GPUs (the hf engine's copy, the export and the checkpoint too)."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "cluster=cpu2", "cluster.parallel=fsdp2",
                           "model.dtype=bfloat16", "algo=dapo", "trainer.steps=2", "trainer.save_every=0", *TINY,
                           "algo.mazes_per_step=4",
                           "algo.max_new_tokens=32", "env.max_turns=6", "algo.group_size=4",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**ENV, "VLMAZE_FAULTS": "uniform_rewards_last_rank@1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = re.findall(r"step 1: groups kept per rank \[(\d+), (\d+)\]", proc.stdout)
    assert kept and int(kept[0][0]) > 0 and int(kept[0][1]) == 0, proc.stdout[-3000:]
    assert "step 2/2" in proc.stdout


def test_sft_last_batch_with_fewer_rows_than_ranks(tmp_path):
    """3 conversations in batches of 2 over 2 ranks: the second step has one row, rank 1 gets none."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "cluster=cpu2", "cluster.parallel=fsdp2",
                           "algo=sft", "algo.sft_mazes=3", "algo.sft_batch=2", "algo.sft_epochs=1",
                           "trainer.eval_every=0", "trainer.save_every=0", "env.max_turns=3",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout and (tmp_path / "checkpoints/step_2/dcp/.metadata").is_file()


def test_submitit_local_sweep_runs_each_job_under_torchrun(tmp_path):
    """hydra-submitit-launcher's local executor (the Slurm launcher's code path, without Slurm): each job
    re-launches under torchrun from Hydra's record of its overrides and writes its eval report."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=submitit_local",
                           "cluster=cpu2", "trainer.seed=0,1", "trainer.steps=1", *TINY, "trainer.eval_every=1",
                           "trainer.eval_at_start=false", "trainer.eval_suites=[size7]", "trainer.save_every=0",
                           f"hydra.sweep.dir={tmp_path}", "hydra.launcher.timeout_min=10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = sorted(tmp_path.glob("*/eval/step_1/report.json"))
    assert len(reports) == 2, sorted(str(p) for p in tmp_path.rglob("*"))[:40]
    logs = "".join(p.read_text() for p in tmp_path.rglob("*_log.out"))
    assert logs.count("relaunching under torchrun") == 2 and logs.count("--nproc-per-node=2") == 2, logs[-3000:]


def test_the_kl_reference_reshards_its_root_after_each_forward(tmp_path):
    """The reference built as a GRPO run with a KL term builds it (``rl.run.build_models``, FSDP2 on 2 gloo ranks):
    after a no-grad forward every parameter is a shard again, embeddings and lm_head included (left to FSDP2, the
    root kept them gathered for the whole run: ~2.5 GB a rank for Qwen3-VL-8B). The policy's root stays gathered
    until its backward, as FSDP2 intends for a trained root."""
    import json

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests/scripts/reference_shards.py"), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["parameters"] > 10 and r["before"] == {"reference": [], "policy": []}
    assert r["reference"] == [], r["reference"]
    assert "lm_head.weight" in r["policy"]  # the contrast: a trained root keeps its gathered weights for backward


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_checkpoint_is_hashed_by_every_rank_a_share_each(tmp_path, ranks):
    """Saving and verifying an FSDP2 checkpoint on gloo ranks: each rank hashes (and fsyncs) its share of the files,
    the shares together cover the manifest once, and with 2 ranks neither holds much more than half the bytes (rank
    0 hashed all of it before, while the others waited on a barrier); the resume search finds the checkpoint; the
    process group's timeout is cluster.collective_timeout_min's; the save's sync check gathers nothing under FSDP2.
    One rank is cluster=1gpu's shape (FSDP2 at world size 1), whose export failed to save before."""
    import json

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(ROOT / "tests/scripts/checkpoint_ranks.py"), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    files = out[0]["files"]
    saving = [set(r["saving"]) for r in out]
    assert all(saving) and set.union(*saving) == set(files) and sum(map(len, saving)) == len(files)
    assert [set(r["verifying"]) for r in out] == saving  # verifying splits the files the same way
    total = sum(files.values())
    if ranks == 2:
        assert max(sum(files[f] for f in s) for s in saving) < 0.7 * total, [sum(files[f] for f in s) for s in saving]
    assert "policy/model.safetensors" in files and "dcp/.metadata" in files
    assert all(r["chosen"].endswith("checkpoints/step_1") and r["timeout_s"] == 420.0 for r in out)
    # the save's sync check under FSDP2: the sum of the shards' checksums, the gathered weights' fingerprint,
    # without gathering a parameter (the old check gathered every one to compare copies equal by construction)
    assert all(r["gathers"] == 0 and abs(r["checksum"] - r["gathered_checksum"]) < 1e-9 * abs(r["checksum"])
               for r in out), out
