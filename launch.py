"""How a training job starts: the dry-run launch plan, the Slurm job script, the torchrun re-launch.

``train.py`` calls these before any heavy work; nothing here loads weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig

from conf.schema import ConfigError
from models import memory
from models.memory import GIB

TRAIN = Path(__file__).resolve().parent / "train.py"


def device_memory(cfg) -> tuple[float, str]:
    """GiB of one GPU of this job and where the figure comes from: the visible device itself (an H100 job plans
    for 80 GB, an H200 one for 141), else ``cluster.gpu_memory_gib`` (a dry run on a machine without the GPU)."""
    if cfg.cluster.device == "cuda" and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        return props.total_memory / 2**30, f"cuda:{index}, {props.name}"
    return float(cfg.cluster.gpu_memory_gib), "cluster.gpu_memory_gib: no GPU visible here"


def resolve_engine_memory(cfg) -> None:
    """Write the planned ``engine.gpu_memory_utilization`` (``memory_plan``: the most of this GPU the trainer leaves
    free, ``models.memory.engine_fraction``) into ``cfg`` for a vLLM job on a GPU with the key at 0, so the
    engine, the logged config and the plan all hold the one figure."""
    if cfg.engine.name != "vllm" or cfg.cluster.device != "cuda" or cfg.engine.gpu_memory_utilization > 0:
        return
    gib, _ = device_memory(cfg)
    if gib > 0:
        cfg.engine.gpu_memory_utilization = memory_plan(cfg, gib)["gpu_util"]


def memory_plan(cfg, gpu_gib: float, units=None, **changes) -> dict:
    """``models.memory.plan`` for this job (the architecture on the meta device, no weights; ``units`` reuses an
    earlier plan's count); ``changes`` try other settings: grad_ckpt, micro_batch, world, gpu_util."""
    world = changes.get("world", cfg.cluster.nproc_per_node * cfg.cluster.nnodes)
    fsdp = (world > 1 or cfg.cluster.device == "cuda") and cfg.cluster.parallel == "fsdp2"  # as needs_torchrun
    if units is None and cfg.model.name == "tiny":
        from models.tiny import build_tokenizer, tiny_config  # transformers: seconds, only for the tiny model

        units = memory.count_units(tiny_config(build_tokenizer()))
    elif units is None:
        units = memory.count_units(memory.arch_config(cfg.model.name))
    micro = changes.get("micro_batch", cfg.algo.micro_batch)
    rows = micro if cfg.algo.name != "sft" else min(micro, cfg.algo.sft_batch)
    seq = memory.sequence_tokens(cfg)
    compute_bytes = 4 if cfg.model.dtype == "float32" else 2
    kw = dict(world=world, compute_bytes=compute_bytes, engine=cfg.engine.name,
              kl=cfg.algo.kl_coef > 0 and cfg.algo.name != "sft", tokens=rows * seq,
              grad_ckpt=changes.get("grad_ckpt", cfg.model.gradient_checkpointing), gpu_gib=gpu_gib, fsdp=fsdp)
    util = changes.get("gpu_util", cfg.engine.gpu_memory_utilization)
    if util == 0 and cfg.engine.name == "vllm" and gpu_gib > 0:  # planned: what the trainer leaves free
        util = memory.engine_fraction(memory.plan(units, **kw, gpu_util=0.0), gpu_gib)
    p = memory.plan(units, **kw, gpu_util=util)
    # a rank's rollout: its episodes at once, each up to ``seq`` tokens (every maze's group on one rank)
    episodes = (cfg.algo.mazes_per_step * cfg.algo.group_size) // max(world, 1) if cfg.algo.name != "sft" else 0
    return {**p, "units": units, "world": world, "fsdp": fsdp, "rows": rows, "seq": seq, "gpu_util": util,
            "compute_bytes": compute_bytes,
            "kv_tokens": memory.kv_cache_tokens(units, compute_bytes, gpu_gib, util) if cfg.engine.name == "vllm"
            else 0, "rollout_tokens": episodes * seq}


def engine_problem(cfg, p: dict) -> str | None:
    """Why vLLM could not start in this plan's budget (its KV cache below one ``engine.max_model_len`` sequence,
    which vLLM refuses at start), or None."""
    if cfg.engine.name != "vllm" or cfg.cluster.device != "cuda" or p["kv_tokens"] >= cfg.engine.max_model_len:
        return None
    return (f"vLLM's budget (engine.gpu_memory_utilization={p['gpu_util']:.2f}) leaves a KV cache of "
            f"{p['kv_tokens']} tokens, below one engine.max_model_len={cfg.engine.max_model_len} sequence")


def check_fits(cfg) -> None:
    """A GPU job whose memory plan exceeds its GPU fails here, before any weights load, in one line naming the
    plan's peak, the GPU's memory and the keys that would make it fit (``cluster.ignore_memory_plan=true``
    starts it anyway). CPU jobs are not planned against a device."""
    if cfg.cluster.device != "cuda" or cfg.cluster.ignore_memory_plan:
        return
    gib, source = device_memory(cfg)
    if gib <= 0:
        return  # nothing to plan against (no GPU visible and no cluster.gpu_memory_gib)
    p = memory_plan(cfg, gib)
    if p["peak"] <= gib * GIB and not engine_problem(cfg, p):
        return
    if p["peak"] <= gib * GIB:
        raise ConfigError(f"{engine_problem(cfg, p)} on a {gib:.0f} GiB GPU ({source}): more GPUs (smaller shards "
                          "leave vLLM more), algo.kl_coef=0 (no reference shard) or a smaller engine.max_model_len; "
                          "dry_run=true prints the plan, cluster.ignore_memory_plan=true starts anyway")
    world = p["world"]
    tries = [("model.gradient_checkpointing=true", dict(grad_ckpt=True)),
             ("algo.micro_batch=1", dict(micro_batch=1)),
             ("model.gradient_checkpointing=true algo.micro_batch=1", dict(grad_ckpt=True, micro_batch=1))]
    if cfg.engine.name == "vllm" and cfg.engine.gpu_memory_utilization > 0:
        tries.append(("engine.gpu_memory_utilization=0 (planned)", dict(gpu_util=0)))
    if world < 8:
        tries.append((f"{8 * cfg.cluster.nnodes} GPUs (cluster=8gpu)", dict(world=8 * cfg.cluster.nnodes)))
    if world < 16:
        tries.append(("16 GPUs (cluster=multinode cluster.nnodes=2)", dict(world=16)))
    fixes = [name for name, change in tries
             if (q := memory_plan(cfg, gib, p["units"], **change))["peak"] <= gib * GIB and not engine_problem(cfg, q)]
    raise ConfigError(
        f"the memory plan needs {p['peak'] / GIB:.1f} GiB per GPU (its {p['peak_phase']} phase) but the GPU has "
        f"{gib:.0f} GiB ({source}): " + (f"it would fit with {' or '.join(fixes)}" if fixes else
                                         "none of more GPUs, gradient checkpointing or a smaller micro-batch fits it")
        + "; dry_run=true prints the plan, cluster.ignore_memory_plan=true starts anyway")


def launch_plan(cfg) -> str:
    """World size, processes, precision, engine and the per-GPU memory plan (``models.memory``: what the code keeps,
    component by component; the architecture is built on the meta device, no weights are loaded), planned for the
    GPU this job would run on (``device_memory``)."""
    torchrun = needs_torchrun(cfg)
    gib, source = device_memory(cfg) if cfg.cluster.device == "cuda" else (0.0, "")
    p = memory_plan(cfg, gib)
    world, units, fsdp, rows, seq = p["world"], p["units"], p["fsdp"], p["rows"], p["seq"]
    lines = [
        f"launch plan: world size {world} ({cfg.cluster.nnodes} node(s) x {cfg.cluster.nproc_per_node} "
        f"process(es)){' under torchrun' if torchrun else ''}, device {cfg.cluster.device}, backend "
        f"{cfg.cluster.backend if torchrun else 'none'}, parallel {cfg.cluster.parallel if torchrun else 'none'}, "
        f"engine {cfg.engine.name}",
        f"model {cfg.model.name} ({units.total / 1e9:.3f} B params: root {units.root / 1e6:.1f} M, vision "
        f"{units.vision / 1e6:.1f} M, {units.layers} decoder layers of {units.layer / 1e6:.1f} M), fp32 master "
        f"weights and AdamW, {cfg.model.dtype} compute" + (" (FSDP2 MixedPrecisionPolicy, fp32 gradient "
                                                           "reduction)" if fsdp else " (autocast)"),
        ("algo sft: " f"{cfg.algo.sft_mazes} {cfg.algo.sft_expert} conversations x {cfg.algo.sft_epochs} epochs, "
         f"{cfg.algo.sft_batch} per step" if cfg.algo.name == "sft" else
         f"algo {cfg.algo.name}: {cfg.algo.mazes_per_step} mazes x {cfg.algo.group_size} samples per step, "
         f"{cfg.trainer.steps} steps"),
        f"tokens per micro-batch <= {rows} x {seq} (prompt {memory.PROMPT_TOKENS} + turns x (image "
        f"{memory.image_tokens(cfg.env, cfg.model)} + text {memory.TURN_TEXT_TOKENS} + response "
        f"{cfg.algo.max_new_tokens})), gradient checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}",
        "per-GPU memory plan (GiB; models/memory.py says what each line counts):",
        *memory.format_plan(p),
    ]
    if cfg.engine.name == "vllm" and gib:
        planned = "planned: the most the trainer leaves free" if cfg.engine.gpu_memory_utilization == 0 else "set"
        lines.append(
            f"vLLM: gpu_memory_utilization {p['gpu_util']:.2f} ({planned}), a KV cache of "
            f"~{p['kv_tokens'] / 1e3:.0f} k "
            f"tokens (the budget less {p['units'].total * p['compute_bytes'] / GIB:.1f} GiB "
            f"of weights and ~{memory.ENGINE_OVERHEAD_GIB:.0f} GiB of activations and graphs); a rank's rollout "
            f"holds up to {p['rollout_tokens'] / 1e3:.0f} k ({p['rollout_tokens'] // max(p['seq'], 1)} episodes x "
            f"{p['seq']})" + ("" if p["kv_tokens"] >= p["rollout_tokens"] else
                              ": vLLM will queue or preempt the rest (slower rollouts, same samples)"))
    if gib:
        problem = engine_problem(cfg, p)
        verdict = ("fits" if p["peak"] <= gib * memory.GIB and not problem else
                   "DOES NOT FIT" + (f" ({problem})" if problem and p["peak"] <= gib * memory.GIB else ""))
        lines.append(f"device memory: {gib:.0f} GiB ({source}): {verdict}")
    return "\n".join(lines)


def write_slurm_script(cfg, run_dir: str) -> Path:
    """The sbatch script submitit would submit for this job (``hydra/launcher=vlmaze_slurm``), written
    with submitit's own generator; a dry run here, where no Slurm is installed."""
    from submitit.slurm.slurm import _make_sbatch_string  # optional: submitit, for cluster=slurm

    c = cfg.cluster
    folder = Path(run_dir) / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("dry_run=")]
    command = " ".join([sys.executable, "-u", str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"])
    params = {"partition": c.partition or None, "nodes": c.nnodes, "gpus_per_node": c.nproc_per_node,
              "ntasks_per_node": 1, "cpus_per_task": c.cpus_per_task, "time": c.timeout_min,
              "job_name": "vlmaze", "signal_delay_s": 120}
    if c.mem_gb:
        params["mem"] = f"{c.mem_gb}GB"
    text = _make_sbatch_string(command=command, folder=str(folder), **params)
    path = folder / "job.sbatch"
    path.write_text(text)
    return path


def needs_torchrun(cfg) -> bool:
    """Every GPU run and every multi-process CPU run trains under torchrun with a process group (cluster=1gpu
    too: a group of one runs the same code as eight); cluster=cpu is one plain process."""
    return cfg.cluster.nproc_per_node * cfg.cluster.nnodes > 1 or cfg.cluster.device == "cuda"


def torchrun_command(cfg, run_dir: str) -> list[str]:
    """torchrun running this script with this job's overrides, every rank writing to ``run_dir``.

    Built from Hydra's record of the job (its overrides), not from ``sys.argv``: under a Hydra launcher the
    process is not ``python train.py ...`` (hydra-submitit-launcher runs ``python -m submitit.core._submit``,
    a multirun job's argv holds the whole sweep). One node: ``--standalone`` (a free local port, so jobs
    sharing a machine never collide); several: the rendezvous endpoint.
    """
    c = cfg.cluster
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={c.nproc_per_node}",
           f"--nnodes={c.nnodes}", f"--max-restarts={c.max_restarts}"]
    if c.nnodes > 1:
        cmd += [f"--rdzv-backend={c.rdzv_backend}", f"--rdzv-endpoint={c.rdzv_endpoint}", f"--rdzv-id={c.rdzv_id}"]
    else:
        cmd += ["--standalone"]
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]
    quoted = "'" + str(run_dir).replace("\\", "\\\\").replace("'", "\\'") + "'"  # a sweep dir holds = and ,
    return cmd + [str(TRAIN), *overrides, f"hydra.run.dir={quoted}"]


# torchrun's agent otherwise shares one store across restarts and torch no longer prefixes the process group's keys
# per attempt: restarted workers could read a dead attempt's addresses (gloo's connect hung or was refused in 4 of 9
# runs of the killed-rank test). Opted out, every rendezvous round gets a fresh store on a fresh port.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def relaunch_under_torchrun(cfg, run_dir: str) -> int:
    cmd = torchrun_command(cfg, run_dir)
    print(f"relaunching under torchrun: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=os.getcwd(), env={**os.environ, **TORCHRUN_ENV})


def final_score(run_dir: str, cfg) -> float | None:
    """The last periodic eval's score on the first suite (what a relaunched job returns to a sweeper)."""
    reports = sorted(Path(run_dir, "eval").glob("step_*/report.json"), key=lambda p: int(p.parent.name[5:]))
    if not reports or not cfg.trainer.eval_suites:
        return None
    return json.loads(reports[-1].read_text())["suites"][cfg.trainer.eval_suites[0]]["success_rate"]
