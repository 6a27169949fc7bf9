"""The config a user reads: one tree of dataclasses, every field with its type, default and one line.

``python scripts/train.py --help`` prints the same from these docstrings. Loading, merging,
overrides and validation are in :mod:`rl_replay.config.loader`; :mod:`rl_replay.config` exports both.
Sizes derived from the config are computed in one place each: :func:`batch_size_per_rank` and
:func:`num_updates`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rl_replay.registry import ALGORITHMS

__all__ = [
    "EnvConfig",
    "AgentConfig",
    "CollectorConfig",
    "LossConfig",
    "PPOConfig",
    "ReplayConfig",
    "OptimConfig",
    "LogConfig",
    "CheckpointConfig",
    "EvalConfig",
    "DistributedConfig",
    "Config",
    "ALGORITHM_NAMES",
    "batch_size_per_rank",
    "num_updates",
]


# --------------------------------------------------------------------------------------
# Config tree
# --------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"
    """gymnasium environment id, or ``module:EnvId`` (the module is imported first and registers it)"""
    num_envs: int = 8
    """number of parallel environments in the vector env"""
    vectorization: str = "sync"
    """vector env implementation: sync | async | vector_entry_point (the env's own batched vector env,
    registered as its ``vector_entry_point``, e.g. ``rl_replay/MemoryCue-v0``; no env.wrappers) |
    envpool (EnvPool's C++ envs, the envpool extra; env.kwargs are EnvPool's options; no env.wrappers)"""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """extra keyword arguments passed to ``gymnasium.make``"""
    max_episode_steps: int | None = None
    """override of the env's time limit (None = keep the registered limit)"""
    imports: list[str] = field(default_factory=list)
    """modules imported before the env is made, e.g. [popgym, my_pkg.envs] (they register ids)"""
    wrappers: list[dict[str, Any]] = field(default_factory=list)
    """gymnasium wrappers applied to each sub-env in order: [{target: module:Class, kwargs: {...}}]"""
    observation_keys: list[str] = field(default_factory=list)
    """keys of a Dict observation to keep, e.g. [image, direction] (empty = every key that holds tensors;
    the others, such as MiniGrid's mission text, are dropped with a warning)"""


@dataclass
class AgentConfig:
    target: str = "mlp"
    """agent class: a built-in name (mlp, gru, lstm, lru, mingru, transformer, gtrxl) or ``module:Class``"""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments passed to the agent's constructor (a config file's kwargs go only to its own
    target: overriding agent.target starts from {} plus the command line's agent.kwargs)"""


@dataclass
class CollectorConfig:
    mode: str = "fixed"
    """fixed: horizon T carried across rollouts | episode: whole episodes from a reset, capped at num_steps"""
    num_steps: int = 5
    """steps T per env per rollout (the per-episode step cap in episode mode)"""
    bptt_truncate: int | None = None
    """cut the recurrent gradient every K steps (None = full backprop through the rollout)"""


#: The values of ``loss.algorithm`` (:data:`rl_replay.registry.ALGORITHMS`).
ALGORITHM_NAMES = tuple(ALGORITHMS)


@dataclass
class LossConfig:
    algorithm: str = "a2c"
    """policy-gradient loss: a2c | reinforce | ppo (see the ``ppo`` section)"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 1.0
    """lambda of generalized advantage estimation"""
    value_coef: float = 0.5
    """weight of the value loss"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (at the start of the run when ``entropy_schedule`` decays it)"""
    entropy_schedule: str = "constant"
    """constant | linear | exponential: how the entropy weight moves from ``entropy_coef`` to
    ``entropy_coef_final`` over ``entropy_decay_env_steps`` (linear in env steps, or by a constant
    factor per env step; exponential needs both weights > 0), then stays at the final weight"""
    entropy_coef_final: float = 0.0
    """the entropy weight at the end of a decaying schedule"""
    entropy_decay_env_steps: int | None = None
    """env steps (over all ranks) the decay takes; None = the run's ``total_env_steps``"""
    normalize_advantages: bool | None = None
    """normalize advantages to zero mean, unit std (None = the algorithm's default: a2c / reinforce
    false, per rollout; ppo true, per minibatch)"""
    baseline: bool = True
    """reinforce only: subtract the learned value as a baseline"""


@dataclass
class PPOConfig:
    """Used when ``loss.algorithm: ppo``; defaults follow CleanRL's ``ppo.py``."""

    epochs: int = 4
    """passes over each rollout (CleanRL update_epochs)"""
    num_minibatches: int = 4
    """minibatches per epoch, split over environments: each holds whole T-step sequences of
    num_envs / num_minibatches envs (must divide env.num_envs)"""
    clip_coef: float = 0.2
    """clip range of the probability ratio (and of the value update with clip_vloss)"""
    clip_vloss: bool = True
    """clip the value update around the collected value"""
    target_kl: float | None = None
    """stop the epochs of an update once a minibatch's approx_kl exceeds this (None = never)"""


@dataclass
class ReplayConfig:
    block_steps: int = 16
    """steps of a stored sequence per replay block (rl_replay.engine.replay_sequence_call), for every
    algorithm: PPO replays each minibatch's sequences in blocks of k steps; A2C and REINFORCE
    collect under no_grad and replay the stored rollout in blocks of k steps before the loss (1 =
    each step is a replay block as the envs are stepped, the graph built during collection). The
    per-block machinery is paid once per block, and one block's steps of activations are alive at
    the backward's peak. Every agent runs a block as one call over its k rows (the shipped recurrent
    agents: encoder and heads over all the block's rows at once); a StepwiseAgent is called step by
    step, with the same gradients (under FSDP then recomputed once more per step: use 1 there). The same gradients up to float rounding where a block is one call, for an agent
    whose forward draws no random numbers; with dropout under A2C / REINFORCE the loss sees other
    masks than the ones that sampled the actions (use 1 for exactly on-policy dropout). Speed:
    docs/benchmarks.md. (Was collector.block_steps for A2C / REINFORCE and ppo.block_steps for PPO;
    both are still read.)"""


@dataclass
class OptimConfig:
    name: str = "rmsprop"
    """optimizer: adam | rmsprop | sgd"""
    lr: float = 7e-4
    """learning rate"""
    eps: float = 1e-5
    """epsilon of adam / rmsprop"""
    max_grad_norm: float | None = 0.5
    """global gradient-norm clip (None = no clipping)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over training"""
    skip_nonfinite_updates: int = 0
    """skip up to N updates whose loss or gradient is NaN/inf (no optimizer step, a warning each); 0 = stop at the first"""


@dataclass
class LogConfig:
    wandb_mode: str = "offline"
    """wandb mode: offline | online | disabled"""
    wandb_project: str = "rl_replay"
    """wandb project name"""
    wandb_entity: str | None = None
    """wandb entity (team or user; None = wandb's default)"""
    run_name: str | None = None
    """run name (None = generated by the trainer)"""
    progress: bool = True
    """show progress: a bar on a terminal; otherwise (a log file) one plain line every progress_every seconds"""
    progress_every: float = 30.0
    """seconds between the plain progress lines written when stderr is not a terminal"""
    log_every: int = 1
    """log metrics every N updates"""
    horizon_every: int = 0
    """every N updates, log horizon/grad_first_obs: the norm of the gradient of an episode's last decision with respect to its first observation, through replay blocks (rl_replay.algorithms.horizon; 0 = never; one process only)"""
    group: str | None = None
    """wandb run group (e.g. one experiment's seeds)"""
    tags: list[str] = field(default_factory=list)
    """wandb run tags"""
    tensorboard: bool = False
    """also write TensorBoard event files into RUN_DIR/tensorboard (needs the tensorboard extra); rows go out once a checkpoint covers them, as wandb's do"""


@dataclass
class CheckpointConfig:
    every: int = 50
    """save a checkpoint every N updates (0 = only at the end)"""
    sharded: bool = True
    """under FSDP with more than one rank (and a strategy that shards): every rank writes its own shard of the weights and optimizer state beside checkpoint.pt; false: rank 0 gathers them into checkpoint.pt"""


@dataclass
class EvalConfig:
    episodes: int = 10
    """number of evaluation episodes (scripts/evaluate.py, and eval.every during training)"""
    every: int = 0
    """during training: evaluate every N updates and at the end, on fresh envs (eval/* metrics; 0 = never; one process only)"""
    deterministic: bool = True
    """act greedily (mode of the action distribution) during evaluation"""


@dataclass
class DistributedConfig:
    fsdp_version: int = 1
    """1: FSDP1 (FullyShardedDataParallel, use_orig_params=True); 2: FSDP2 (fully_shard on each unit, then
    the root). The strategies below map onto FSDP2's own: FULL_SHARD is reshard_after_forward=True,
    SHARD_GRAD_OP False, HYBRID_SHARD a (replicate, shard) device mesh, NO_SHARD a mesh of shard size 1
    (docs/scaling.md)"""
    wrap_modules: list[str] = field(default_factory=list)
    """module class names; each instance becomes its own FSDP unit"""
    min_num_params: int | None = None
    """size-based FSDP auto-wrap instead of wrap_modules (None = off)"""
    cpu_offload: bool = False
    """offload FSDP parameters to CPU"""
    mixed_precision: str | None = None
    """FSDP mixed precision: None | bf16 | fp16"""
    backend: str = "auto"
    """torch.distributed backend: auto | gloo | nccl"""
    sharding_strategy: str = "FULL_SHARD"
    """FSDP1 sharding: FULL_SHARD (parameters gathered per unit for each forward and backward) |
    SHARD_GRAD_OP (kept gathered from forward to backward) | HYBRID_SHARD (FULL_SHARD within a node of
    LOCAL_WORLD_SIZE ranks, replicated across nodes) | NO_SHARD (replicated, gradients all-reduced)"""
    collect_gathered: str = "auto"
    """collection under FSDP: true gathers the full parameters once per rollout, false gathers each unit
    at every env step; auto gathers once when the full parameters fit half this rank's free memory
    (docs/scaling.md). The choice is printed once"""


@dataclass
class Config:
    seed: int = 1
    """random seed"""
    device: str = "cpu"
    """torch device: cpu | cuda | auto"""
    total_env_steps: int = 500_000
    """total environment steps to train for (summed over all envs)"""
    run_dir: str | None = None
    """output directory of the run (None = chosen by the trainer)"""
    torch_threads: int | None = 1
    """CPU threads for torch ops (None = torch's default). Small policies run fastest on one
    thread; several threads on an oversubscribed machine can be orders of magnitude slower"""
    keep_freed_memory: bool = True
    """let glibc keep freed memory for reuse (rl_replay.engine.keep_freed_memory): each replay block's
    gradient buffers are then not page-faulted in again; peak RSS stays at its maximum"""
    init_from: str | None = None
    """start the agent's weights from another run's checkpoint (its run directory, or a checkpoint
    file): a warm start, e.g. a curriculum that continues a shorter task's agent on a longer one.
    Only the weights are taken: optimizer, counters and RNG streams start fresh. The agent must be
    the same (target, kwargs, observation and action spaces). A resumed run loads its own checkpoint
    and ignores this"""
    env: EnvConfig = field(default_factory=EnvConfig)
    """environment"""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """agent (policy / value network)"""
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    """rollout collection"""
    loss: LossConfig = field(default_factory=LossConfig)
    """policy-gradient loss"""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO update (loss.algorithm: ppo)"""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """replaying stored sequences in blocks (every algorithm)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer"""
    log: LogConfig = field(default_factory=LogConfig)
    """logging"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """checkpointing"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """evaluation"""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """distributed (FSDP) training"""


# --------------------------------------------------------------------------------------
# Derived sizes
# --------------------------------------------------------------------------------------


def batch_size_per_rank(cfg: Config) -> int:
    """Env steps one rank collects per update: ``num_envs * num_steps``.

    An upper bound in episode mode, where episodes may end before the step cap.
    """
    return cfg.env.num_envs * cfg.collector.num_steps


def num_updates(cfg: Config, *, world_size: int) -> int:
    """Updates a run takes: ``ceil(total_env_steps / (num_envs * num_steps * world_size))``.

    Every rank runs ``env.num_envs`` envs, so an update consumes ``world_size`` times the
    per-rank batch. Exact in ``fixed`` mode; in ``episode`` mode an update takes as many
    steps as its longest episode (at most the cap), so this is only the fewest updates the
    trainer may need: it keeps updating until ``total_env_steps`` are reached.
    """
    return math.ceil(cfg.total_env_steps / (batch_size_per_rank(cfg) * world_size))
