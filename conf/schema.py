"""The one schema of every config group, documented where each key is declared.

Each group's YAML options (conf/<group>/*.yaml) start from ``base_<group>`` below, so a
mistyped key in an option file or an override (``algo.group_sise=4``) and a wrongly typed
value (``algo.group_size=abc``) fail at compose time with Hydra's own message, and an unknown
option (``algo=grpoo``) lists the available ones. Cross-key checks live in ``validate``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, OmegaConf

from conf.recorded import RecordError, recorded
from maze.core import GENERATORS, MAX_SIZE, MIN_SIZE
from maze.env import EnvSettings, frame_side
from maze.suites import load_suite


@dataclass
class ModelConfig:
    name: str = "tiny"  # tiny | qwen3_vl_2b | qwen3_vl_4b | qwen3_vl_8b
    path: str | None = None  # hub id or local HF dir; for tiny: an HF dir to start from (else random init)
    init_seed: int = 0  # tiny only: seed of the random initialisation
    tiny_layers: int = 3  # tiny, random init only: language-model layers (a checkpoint brings its own)
    tiny_hidden: int = 128  # tiny, random init only: language-model width, a multiple of 64
    tiny_vision_depth: int = 3  # tiny, random init only: vision-tower layers (>= 2; the last two feed deepstack)
    tiny_vision_hidden: int = 96  # tiny, random init only: vision-tower width, a multiple of 32 (heads of 32)
    dtype: str = "float32"  # float32 | bfloat16 (trainer compute dtype)
    attn_implementation: str = "auto"  # auto (flash_attention_2 on CUDA for bf16/fp16 when usable, else sdpa) | sdpa
    # | eager | flash_attention_2 (not with model.dtype=float32: flash-attention has no fp32 kernel)
    trust_remote_code: bool = False  # never on unless you set it
    min_pixels: int = 1024  # processor lower bound on image pixels
    max_pixels: int = 102400  # processor upper bound on image pixels (320 x 320)
    gradient_checkpointing: bool = False


@dataclass
class MixConfig:
    """One kind of training maze in ``env.train_mix`` (``maze.sampler.MixItem``)."""

    size: int = 9
    generator: str = "wilson"  # wilson|backtracker|prim|kruskal|sidewinder
    braid: float = 0.0
    placement: str = "corners4"  # corners4 | corners | random
    weight: float = 1.0  # drawn with probability weight / sum of weights


@dataclass
class EnvConfig(EnvSettings):
    """``env.*``: the environment's settings (``maze.env.EnvSettings``: their defaults and documentation live
    there, once) and the training distribution below."""

    train_sizes: list[int] = field(default_factory=list)  # training size mixture; empty = [size]
    generators: list[str] = field(default_factory=lambda: ["wilson"])  # wilson|backtracker|prim|kruskal
    braid: float = 0.0  # fraction of dead ends opened in training mazes
    placement: str = "corners4"  # corners4: one of the reference's four corner pairs | corners: top-left to
    # bottom-right only | random: two rooms at BFS distance >= the size
    # A weighted mixture of maze kinds; when set it replaces the four keys above (which then must keep their
    # defaults). E.g. env.train_mix='[{size:7},{size:9,generator:prim},{size:11,braid:0.5,weight:2}]'
    train_mix: list[MixConfig] = field(default_factory=list)
    curriculum: str = "none"  # none | size (sizes of the mix unlock smallest first) | reverse (starts move from
    # next to the goal out to the real start) | replay (re-draw the mazes the policy failed)
    curriculum_steps: int = 0  # size/reverse: the curriculum reaches the full distribution at this step (0: the
    # run's last step)
    replay_fraction: float = 0.5  # replay: share of each step's mazes drawn from the failure buffer
    replay_capacity: int = 256  # replay: mazes kept in the buffer (newest)


@dataclass
class AlgoConfig:
    name: str = "grpo"  # grpo | dr_grpo | dapo | gspo | rloo | sft
    group_size: int = 4  # G samples of the same maze per group
    mazes_per_step: int = 8  # B groups per optimizer step (global, over all ranks; divisible by world size)
    lr: float = 3e-4  # the tiny CPU recipe's; experiments for real models set their own (reference_8b: 1e-6)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # cosine (to 0 at the last step) | constant, after the linear warmup; cosine is the
    # CPU recipe's (at a constant 3e-4 two of three seeds fell back from their peak by step 80, on the previous
    # start: results/provenance.md)
    adv_estimator: str = "grpo"  # grpo | rloo
    adv_level: str = "turn"  # episode | turn: GiGPO's step-level advantage from shared anchor states, added
    step_adv_weight: float = 1.0  # adv_level=turn: weight of the step-level advantage
    gamma: float = 0.95  # adv_level=turn: discount of the per-turn rewards in a turn's return
    norm_adv_by_std: bool = True  # false = Dr. GRPO
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low = DAPO clip-higher
    ratio_level: str = "token"  # token | sequence (GSPO)
    loss_agg: str = "seq_mean_token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_len: int = 512  # constant length of seq_mean_token_sum_norm
    kl_coef: float = 0.0  # 0 = no reference model is built
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in: str = "loss"  # loss | reward
    entropy_coef: float = 0.0
    filter_zero_std: bool = False  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    tis_cap: float = 0.0  # truncated importance sampling cap on exp(old - rollout); 0 = off
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    micro_batch: int = 8  # sequences per forward (gradient accumulation inside a minibatch)
    grad_clip: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 24  # per turn
    eps: float = 1e-6
    sft_epochs: int = 3  # algo=sft: passes over the expert data
    sft_mazes: int = 256  # algo=sft: number of training mazes turned into expert conversations
    sft_batch: int = 8  # algo=sft: conversations per optimizer step
    sft_noise: float = 0.0  # algo=sft: chance of a random (untrained) move per turn, so the data holds recoveries
    sft_max_turns: int = 0  # algo=sft: cut expert conversations after this many turns (0 = env.max_turns x 2)
    sft_random_start: float = 0.0  # algo=sft: fraction of expert conversations that start on a random floor cell
    sft_thought: bool = True  # algo=sft: each expert turn first says what it sees (<think>facing ..; open ..</think>)
    sft_lookahead: int = 0  # algo=sft, thought on: > 0 says instead which open ways enter a dead-end pocket at most
    # this many cells deep (<think>open up down left; not down</think>): the local feature that decides junctions
    sft_expert: str = "bfs"  # algo=sft: bfs (shortest path) | wall_follower (right-hand rule, local decisions) |
    # greedy (depth-first search toward the goal that ignores what its lookahead thought says: rl/policies.py)
    sft_aux_weight: float = 0.0  # algo=sft: weight of a visual auxiliary target: a fixed random linear readout of
    # the agent's image token predicts the open ways and the pockets (algo.sft_lookahead deep) at its cell
    # (rl/sft.py); 0 = off. Needs env.view=egocentric and the shared-image forward (no FSDP2)


@dataclass
class RewardConfig:
    name: str = "sparse"  # sparse | shaped
    success: float = 1.0
    progress: float = 0.0  # x fraction of the BFS distance closed
    step_cost: float = 0.0  # per turn
    bump_penalty: float = 0.0
    invalid_penalty: float = 0.0
    revisit_penalty: float = 0.0
    wrong_stop_penalty: float = 0.0  # a stop away from the goal; with step costs and revisit penalties a failing
    # episode that stops early beats one that keeps trying, unless stopping wrong costs at least as much
    thought_pockets: float = 0.0  # per turn whose thought names exactly the dead-end pockets next to the agent
    # (`<think>open ..; not down</think>`, algo.sft_lookahead's format; maze.core.dead_ends at depth
    # thought_lookahead): a verifiable reward on reading the image, the skill a tiny policy's failures come from
    thought_lookahead: int = 8  # the pocket depth thought_pockets checks (the start's algo.sft_lookahead)


@dataclass
class EngineConfig:
    name: str = "hf"  # hf | vllm
    micro_batch: int = 64  # hf: episodes per generate call
    gpu_memory_utilization: float = 0.0  # vllm on GPU: its share of the GPU (weights, KV cache, activations); 0 =
    # planned at start (launch.resolve_engine_memory): the most the trainer's shards leave free, e.g. 0.76 of
    # an 80 GB H100 for Qwen3-VL-8B on 8 GPUs; vLLM refuses to start unless that share is free
    enforce_eager: bool = False  # vllm
    sleep_mode: bool = True  # vllm on GPU: free KV cache and offload weights during training
    max_model_len: int = 8192  # vllm
    cpu_kv_cache_mib: int = 256  # vllm on CPU: KV cache size (explicit, so it does not depend on what else runs)
    logprob_gap_warn: float = 0.05  # warn when mean |engine - trainer| logprob exceeds this


@dataclass
class ClusterConfig:
    name: str = "cpu"  # cpu | cpu2 | 1gpu | 8gpu | multinode | slurm
    device: str = "cpu"  # cpu | cuda
    nproc_per_node: int = 1  # > 1 re-launches under torchrun
    nnodes: int = 1
    backend: str = "gloo"  # gloo | nccl
    parallel: str = "ddp"  # ddp | fsdp2 (only used when world size > 1)
    max_restarts: int = 0  # torchrun --max-restarts (elastic restarts)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:29500"
    rdzv_id: str = "vlmaze"
    gpu_memory_gib: float = 0.0  # GiB of one GPU to plan for when none is visible (a dry run elsewhere); a visible
    # GPU's own size wins
    ignore_memory_plan: bool = False  # start a GPU job whose memory plan exceeds its GPU (launch.check_fits)
    collective_timeout_min: float = 30.0  # how long a collective waits for the slowest rank before the job fails:
    # above the longest a rank works alone (its share of a checkpoint's hashing, a long eval episode); torch's
    # default is 10 minutes under NCCL
    partition: str = ""  # slurm
    timeout_min: int = 240  # slurm
    cpus_per_task: int = 64  # slurm
    mem_gb: int = 0  # slurm; 0 = the partition's default


@dataclass
class TrainerConfig:
    steps: int = 80  # optimizer steps (GRPO) or, for sft, ignored (see algo.sft_epochs); 80: the CPU default job
    seed: int = 0
    eval_every: int = 20  # 0 = never; eval also runs at step 0 and at the end when > 0
    eval_suites: list[str] = field(default_factory=lambda: ["fixed64"])
    eval_at_start: bool = True  # also evaluate before the first step (the "start" of start -> end)
    eval_max_turns: int = 0  # 0 = env.max_turns
    save_every: int = 10  # 0 = only at the end
    resume: str = "auto"  # auto | never | a checkpoint path
    keep_last: int = 3
    deterministic: bool = True
    max_nonfinite_steps: int = 3  # stop after this many NaN/inf steps in a row
    log_transcripts: int = 2
    packing: bool = False  # padding-free packing in the trainer's forward (models/forward.py); pays off when padded


@dataclass
class Config:
    model: ModelConfig = MISSING
    env: EnvConfig = MISSING
    algo: AlgoConfig = MISSING
    reward: RewardConfig = MISSING
    engine: EngineConfig = MISSING
    cluster: ClusterConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dry_run: bool = False  # compose, validate, print the launch plan, exit


GROUPS = {"model": ModelConfig, "env": EnvConfig, "algo": AlgoConfig, "reward": RewardConfig,
          "engine": EngineConfig, "cluster": ClusterConfig}


def short_name(text: str, limit: int = 120) -> str:
    """A file-name-safe sweep job's dir name: one directory, not a tree (a path value such as
    ``model.path=outputs/x/policy`` has its ``/`` replaced by ``_``), and long override lists keep their start
    and a hash of the whole."""
    text = str(text).replace("/", "_")
    if len(text) <= limit:
        return text
    return f"{text[:limit - 9]}~{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def register() -> None:
    if not OmegaConf.has_resolver("vlmaze_short"):
        OmegaConf.register_new_resolver("vlmaze_short", short_name)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


class ConfigError(ValueError):
    """A config value a user set that cannot work; the message names the key."""


def _check_mix(env) -> None:
    """``env.train_mix`` and the curriculum keys: each element's values, and no half-used combination."""
    for i, item in enumerate(env.train_mix):
        key = f"env.train_mix[{i}]"
        if not (MIN_SIZE <= item.size <= MAX_SIZE) or item.size % 2 == 0:
            raise ConfigError(f"{key}.size={item.size} must be odd and in [{MIN_SIZE}, {MAX_SIZE}]")
        if item.generator not in GENERATORS:
            raise ConfigError(f"{key}.generator={item.generator!r} is not one of {', '.join(GENERATORS)}")
        if item.placement not in CHOICES["env.placement"]:
            raise ConfigError(f"{key}.placement={item.placement!r} is not one of {', '.join(CHOICES['env.placement'])}")
        if not 0 <= item.braid <= 1:
            raise ConfigError(f"{key}.braid={item.braid} must be in [0, 1]")
        if item.weight <= 0:
            raise ConfigError(f"{key}.weight={item.weight} must be > 0")
    if env.train_mix:
        defaults = EnvConfig()
        for name in ("train_sizes", "generators", "braid", "placement"):
            if getattr(env, name) != getattr(defaults, name):
                raise ConfigError(f"env.{name} is set with env.train_mix; the mix names every kind it draws "
                                  f"(put {name} into its elements)")
    if env.curriculum == "size" and len({m.size for m in env.train_mix}) < 2:
        raise ConfigError("env.curriculum=size needs env.train_mix with at least two sizes")
    if env.curriculum_steps < 0:
        raise ConfigError(f"env.curriculum_steps={env.curriculum_steps} must be >= 0")
    if env.replay_capacity < 1:
        raise ConfigError(f"env.replay_capacity={env.replay_capacity} must be >= 1")
    if not 0 < env.replay_fraction < 1:
        raise ConfigError(f"env.replay_fraction={env.replay_fraction} must be in (0, 1)")


def _trained_sizes(env) -> set[int]:
    """Every maze size a run's training draws (``env.size``, ``env.train_sizes``, the mixture's)."""
    return {env.size, *env.train_sizes, *(m.size for m in env.train_mix)}


def _check_frames_fit(cfg) -> None:
    """Every size the run draws or evaluates must reach the model at its own resolution: a frame larger than
    ``model.max_pixels`` is resized by the processor, and resized walls blur across patches."""
    env = cfg.env
    sizes = _trained_sizes(env)
    for name in cfg.trainer.get("eval_suites", None) or []:
        try:
            sizes.update(m.size for m in load_suite(name).mazes)
        except KeyError as err:
            raise ConfigError(f"trainer.eval_suites: {err.args[0]}") from None
    for size in sorted(sizes):
        _, side = frame_side(size, env.pixels_per_cell, env.pad_to, env.pad_before, env.view)
        if side * side > cfg.model.max_pixels:
            raise ConfigError(f"model.max_pixels={cfg.model.max_pixels} is smaller than the {side}x{side} px frame "
                              f"of a {size}x{size} maze (env.view={env.view}, env.pixels_per_cell="
                              f"{env.pixels_per_cell}): the processor would resize it; raise model.max_pixels")


CHOICES = {
    "model.name": ("tiny", "qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "env.placement": ("corners", "corners4", "random"),
    "env.curriculum": ("none", "size", "reverse", "replay"),
    "algo.name": ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "sft"),
    "algo.adv_estimator": ("grpo", "rloo"),
    "algo.adv_level": ("episode", "turn"),
    "algo.ratio_level": ("token", "sequence"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.kl_in": ("loss", "reward"),
    "algo.sft_expert": ("bfs", "wall_follower", "greedy"),
    "algo.lr_schedule": ("constant", "cosine"),
    "reward.name": ("sparse", "shaped"),
    "engine.name": ("hf", "vllm"),
    "cluster.device": ("cpu", "cuda"),
    "cluster.backend": ("gloo", "nccl"),
    "cluster.parallel": ("ddp", "fsdp2"),
}


def given_keys() -> set[str]:
    """The keys set on this run's command line (``env.pixels_per_cell``, ``+experiment``, ...); empty outside a
    Hydra app (a config composed in a test)."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


OBSERVATION_KEYS = ("view", "pixels_per_cell", "pad_to", "pad_before", "wall_gray", "grid_lines", "interface",
                    "history")  # what a policy reads: a start trained on other values sees a different input


def _check_start_observation(cfg) -> None:
    """A start (``model.path``) whose recorded run (``policy/vlmaze_config.yaml``) saw another observation than this
    run's ``env`` settings: a policy trained on one frame layout or prompt does not read another, and the run would
    train on it silently. Keys given on the command line are taken as meant (fine-tuning to a new observation)."""
    path = cfg.model.get("path")
    if not path or not Path(str(path)).is_dir():
        return
    try:
        env = recorded(path, "env")
    except RecordError as err:  # a corrupt record: one line naming it
        raise ConfigError(f"model.path={path}: {err}") from None
    given = given_keys()
    differ = [(k, env[k], cfg.env[k]) for k in OBSERVATION_KEYS
              if k in env and env[k] != cfg.env[k] and f"env.{k}" not in given]
    if differ:
        raise ConfigError(f"model.path={path} was trained with " + " ".join(f"env.{k}={r}" for k, r, _ in differ)
                          + " but this run has " + " ".join(f"env.{k}={v}" for k, _, v in differ)
                          + ": give the start's values (or these keys on the command line to train on a new "
                          "observation)")


def start_warnings(cfg) -> list[str]:
    """Settings that are legal but do not do what a reader may think: one line each, logged at start."""
    a, out = cfg.algo, []
    if a.name != "sft" and a.ppo_epochs == 1 and a.minibatches == 1 and (a.clip_high != a.clip_low
                                                                          or a.ratio_level == "sequence"):
        out.append("algo.clip_low/clip_high/ratio_level act only off-policy: with one update per step "
                   "(algo.ppo_epochs=1, algo.minibatches=1) every ratio is 1 and the clip is never reached")
    if a.name != "sft" and cfg.env.max_images_in_context:
        k = cfg.env.max_images_in_context
        out.append(f"env.max_images_in_context={k}: each episode is trained as one sequence, so turns before the "
                   f"last {k} are trained without the frames they were sampled from (env.history=K trains each "
                   "turn with the context it was sampled with)")
    return out


def validate(cfg) -> None:
    """Cross-key checks, run before any heavy work. Raises ConfigError naming the key."""
    def get(key):
        return OmegaConf.select(cfg, key)

    for key, options in CHOICES.items():
        if get(key) not in options:
            raise ConfigError(f"{key}={get(key)!r} is not one of {', '.join(options)}")
    try:
        EnvSettings.from_config(cfg.env).check()  # the environment's own validation, one place
    except ValueError as err:
        raise ConfigError(f"env.{err}") from None
    for key in [f"env.train_sizes[{i}]" for i in range(len(cfg.env.train_sizes))]:
        size = get(key)
        if not (MIN_SIZE <= size <= MAX_SIZE) or size % 2 == 0:
            raise ConfigError(f"{key}={size} must be odd and in [{MIN_SIZE}, {MAX_SIZE}]")
    for g in cfg.env.generators:
        if g not in GENERATORS:
            raise ConfigError(f"env.generators contains {g!r}; choose from {', '.join(GENERATORS)}")
    _check_mix(cfg.env)
    _check_frames_fit(cfg)
    _check_start_observation(cfg)
    positive = ["algo.group_size",
                "algo.mazes_per_step", "algo.ppo_epochs", "algo.minibatches", "algo.micro_batch",
                "algo.max_new_tokens", "algo.sft_epochs", "algo.sft_mazes", "algo.sft_batch",
                "cluster.nproc_per_node", "cluster.nnodes", "trainer.steps"]
    for key in positive:
        if get(key) < 1:
            raise ConfigError(f"{key}={get(key)} must be >= 1")
    for key in ["algo.lr", "algo.clip_low", "algo.clip_high", "algo.kl_coef", "algo.entropy_coef",
                "algo.tis_cap", "algo.temperature", "algo.sft_lookahead", "env.braid", "trainer.eval_every",
                "trainer.save_every", "trainer.keep_last"]:
        if get(key) < 0:
            raise ConfigError(f"{key}={get(key)} must be >= 0")
    if cfg.model.tiny_hidden < 64 or cfg.model.tiny_hidden % 64:
        raise ConfigError(f"model.tiny_hidden={cfg.model.tiny_hidden} must be a positive multiple of 64")
    if cfg.model.tiny_vision_hidden < 32 or cfg.model.tiny_vision_hidden % 32:
        raise ConfigError(f"model.tiny_vision_hidden={cfg.model.tiny_vision_hidden} must be a positive multiple of 32")
    if cfg.model.attn_implementation == "flash_attention_2" and cfg.model.dtype == "float32":
        raise ConfigError("model.attn_implementation=flash_attention_2 has no float32 kernel: set model.dtype=bfloat16 "
                          "or model.attn_implementation=auto (sdpa for float32)")
    if cfg.model.tiny_vision_depth < 2 or cfg.model.tiny_layers < 2:
        raise ConfigError("model.tiny_layers and model.tiny_vision_depth must be >= 2 (deepstack feeds two layers)")
    if cfg.reward.thought_pockets and cfg.env.interface != "vlmaze":
        raise ConfigError(f"reward.thought_pockets={cfg.reward.thought_pockets} reads vlmaze's lookahead thoughts; "
                          f"env.interface={cfg.env.interface!r} has none")
    if cfg.reward.thought_lookahead < 1:
        raise ConfigError(f"reward.thought_lookahead={cfg.reward.thought_lookahead} must be >= 1")
    if not 0 <= cfg.algo.gamma <= 1:
        raise ConfigError(f"algo.gamma={cfg.algo.gamma} must be in [0, 1]")
    if not 0 < cfg.algo.top_p <= 1:
        raise ConfigError(f"algo.top_p={cfg.algo.top_p} must be in (0, 1]")
    if cfg.env.braid > 1:
        raise ConfigError(f"env.braid={cfg.env.braid} must be <= 1")
    if not 0 <= cfg.algo.sft_random_start <= 1:
        raise ConfigError(f"algo.sft_random_start={cfg.algo.sft_random_start} must be in [0, 1]")
    if not 0 <= cfg.algo.sft_noise < 1:
        raise ConfigError(f"algo.sft_noise={cfg.algo.sft_noise} must be in [0, 1)")
    if cfg.algo.sft_max_turns < 0:
        raise ConfigError(f"algo.sft_max_turns={cfg.algo.sft_max_turns} must be >= 0")
    if cfg.algo.sft_aux_weight < 0:
        raise ConfigError(f"algo.sft_aux_weight={cfg.algo.sft_aux_weight} must be >= 0")
    if cfg.algo.sft_aux_weight > 0:
        aux = f"algo.sft_aux_weight={cfg.algo.sft_aux_weight}"
        if cfg.algo.name != "sft":
            raise ConfigError(f"{aux} is an SFT target; algo.name={cfg.algo.name} does not use it")
        if cfg.env.view != "egocentric" or cfg.env.pad_to % 32:
            raise ConfigError(f"{aux} reads the agent's image token, which only env.view=egocentric (with env.pad_to "
                              f"a multiple of 32) keeps in one place; this run has env.view={cfg.env.view} "
                              f"env.pad_to={cfg.env.pad_to}")
        if cfg.algo.sft_lookahead < 1:
            raise ConfigError(f"{aux} predicts the pockets algo.sft_lookahead cells deep: set algo.sft_lookahead >= 1")
        torchrun = cfg.cluster.nproc_per_node * cfg.cluster.nnodes > 1 or cfg.cluster.device == "cuda"
        if cfg.cluster.parallel == "fsdp2" and torchrun:  # launch.needs_torchrun: a group of one shards too
            raise ConfigError(f"{aux} reads the vision features of the shared-image forward, which FSDP2 does not "
                              "use: set cluster.parallel=ddp (or run cluster=cpu)")
        ppc, inside = cfg.env.pixels_per_cell, cfg.env.pad_before % 32
        if inside + ppc > 32:
            raise ConfigError(f"{aux} reads the one image token that holds the agent's cell, but env.pad_before="
                              f"{cfg.env.pad_before} with env.pixels_per_cell={ppc} puts the cell across tokens "
                              f"(it starts {inside} px into a 32 px token)")
        for size in sorted(_trained_sizes(cfg.env)):
            _, side = frame_side(size, ppc, cfg.env.pad_to, cfg.env.pad_before, cfg.env.view)
            if side * side < cfg.model.min_pixels:
                raise ConfigError(f"{aux}: a {size}x{size} frame ({side} px a side) is below model.min_pixels="
                                  f"{cfg.model.min_pixels}: the processor would enlarge it and move the agent's token")
    if cfg.algo.name != "sft":
        if cfg.algo.group_size == 1 and cfg.algo.adv_estimator == "grpo" and cfg.algo.norm_adv_by_std:
            raise ConfigError("algo.group_size=1 with algo.norm_adv_by_std=true: a group of one has no std")
        if cfg.algo.group_size == 1 and cfg.algo.adv_estimator == "rloo":
            raise ConfigError("algo.group_size=1 with algo.adv_estimator=rloo needs >= 2 samples")
        if cfg.algo.temperature == 0:
            raise ConfigError("algo.temperature=0 makes every sample of a group identical; use > 0")
    world = cfg.cluster.nproc_per_node * cfg.cluster.nnodes
    if cfg.algo.mazes_per_step % world:
        raise ConfigError(f"algo.mazes_per_step={cfg.algo.mazes_per_step} is not divisible by the world "
                          f"size {world} (cluster.nproc_per_node x cluster.nnodes)")
    if cfg.algo.name == "sft" and cfg.algo.sft_batch < world:
        raise ConfigError(f"algo.sft_batch={cfg.algo.sft_batch} is smaller than the world size {world}: some ranks "
                          "would train on nothing in every step; use algo.sft_batch >= the number of processes")
    if cfg.cluster.device == "cpu" and cfg.cluster.backend == "nccl":
        raise ConfigError("cluster.backend=nccl needs cluster.device=cuda")
    if cfg.cluster.collective_timeout_min <= 0:
        raise ConfigError(f"cluster.collective_timeout_min={cfg.cluster.collective_timeout_min} must be > 0 (minutes)")
    if not 0 <= cfg.engine.gpu_memory_utilization < 1:
        raise ConfigError(f"engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization} must be in [0, 1) (0: "
                          "planned from the GPU's memory)")
    if cfg.engine.name == "vllm" and cfg.model.dtype == "float32" and cfg.cluster.device == "cuda":
        raise ConfigError("engine=vllm on GPU expects model.dtype=bfloat16")
    if cfg.trainer.resume not in ("auto", "never") and not cfg.trainer.resume:
        raise ConfigError("trainer.resume must be auto, never or a checkpoint path")


def check_hardware(cfg, gpus: int) -> None:
    """Combinations that make no sense on this machine (``gpus`` CUDA devices), checked after the dry run
    (which plans for any machine) and before any heavy work. Raises ConfigError naming the keys."""
    if cfg.cluster.device == "cuda" and gpus < cfg.cluster.nproc_per_node:
        raise ConfigError(f"cluster={cfg.cluster.name} runs {cfg.cluster.nproc_per_node} processes per node on "
                          f"cluster.device=cuda, but this machine has {gpus} GPU(s); use a cluster that fits "
                          "(cpu, cpu2, 1gpu) or dry_run=true to see the plan")
    if cfg.cluster.device == "cpu" and gpus > 0 and cfg.model.name != "tiny":
        raise ConfigError(f"model={cfg.model.name} on cluster={cfg.cluster.name} (cluster.device=cpu) would train "
                          "a real model on the CPU while a GPU sits idle (or vLLM takes it); use cluster=1gpu or "
                          "cluster=8gpu")


@dataclass
class EvaluateConfig:
    """Top-level schema of ``evaluate.py`` (conf/evaluate.yaml).

    It composes the same groups as training, so ``+experiment=NAME`` evaluates with that experiment's model,
    environment and engine; the algo/reward/cluster/trainer groups are composed (and validated by their
    schemas) but not used, except ``algo.max_new_tokens`` as the default per-turn limit.
    """

    checkpoint: str | None = None  # a vlmaze checkpoint dir (…/step_N), its policy/ dir, an HF dir or hub id
    policy: str = "model"  # model | oracle | random | wall_follower | greedy | lookahead8 (rl/policies.py)
    # suite names, or the string "list" to print the available suites
    suites: Any = field(default_factory=lambda: ["fixed64", "size7", "size11", "gen_prim", "braided"])
    samples: int = 1  # episodes per maze; > 1 reports pass@k
    temperature: float = 0.0  # 0 = greedy; set > 0 with samples > 1
    seed: int = 0
    max_new_tokens: int = 0  # per turn; 0 = algo.max_new_tokens (the training limit)
    compare: list[str] = field(default_factory=list)  # report.json paths: print a side-by-side table and exit
    model: ModelConfig = MISSING
    env: EnvConfig = MISSING
    engine: EngineConfig = MISSING
    algo: AlgoConfig = MISSING
    reward: RewardConfig = MISSING
    cluster: ClusterConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    figures: bool = True
    failed_grid: int = 12  # failed episodes drawn in the failure grid


def register_evaluate() -> None:
    register()  # the group schemas (base_model, base_env, ...) the evaluate config composes
    ConfigStore.instance().store(name="base_evaluate", node=EvaluateConfig)
