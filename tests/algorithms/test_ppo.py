"""PPO on replay blocks: gradient parity with plain autograd over the stored rollout,
whole-sequence minibatches from the stored start state, target_kl, memory linear in T,
no graph outliving a minibatch, 2-rank FSDP parity, config validation, trainer smoke."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from _reference import plain_sequence
from conftest import assert_grads_match
from tensordict import TensorDict

import rl_replay.algorithms.ppo as ppo_module
from rl_replay.agent import build_agent
from rl_replay.algorithms.losses import gae_targets, ppo_loss, total_loss
from rl_replay.algorithms.ppo import PPO
from rl_replay.config import load_config
from rl_replay.rollout.collector import Collector
from rl_replay.rollout.environment import make_vector_env

GRU = ("gru", {"hidden_size": 16, "encoder_sizes": [16]})
MLP = ("mlp", {"hidden_sizes": [16, 16]})


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step records each parameter's gradient and leaves it unchanged."""

    def __init__(self, params, fsdp_model=None):
        super().__init__(params, {})
        self.fsdp_model = fsdp_model  # record the full (unsharded) gradients of this FSDP model
        self.grads: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        if self.fsdp_model is None:
            self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.fsdp_model, with_grads=True):
            self.grads.append([p.grad.detach().clone() for p in self.fsdp_model.parameters()])


def ppo_cfg(num_envs: int, num_steps: int, *extra: str):
    return load_config(
        None,
        [
            "loss.algorithm=ppo",
            f"env.num_envs={num_envs}",
            f"collector.num_steps={num_steps}",
            "loss.entropy_coef=0.01",
            "loss.gae_lambda=0.95",
            "optim.max_grad_norm=null",
            "log.wandb_mode=disabled",
            *extra,
        ],
    )


def make_setup(agent=GRU, *, num_envs=4, num_steps=60, max_episode_steps=25, seed=3, extra=()):
    cfg = ppo_cfg(num_envs, num_steps, *extra)
    envs = make_vector_env("CartPole-v1", num_envs, max_episode_steps=max_episode_steps)
    torch.manual_seed(seed)
    model = build_agent(agent[0], agent[1], envs.single_observation_space, envs.single_action_space)
    collector = Collector(envs, model, num_steps=num_steps, seed=seed, bptt_truncate=cfg.collector.bptt_truncate)
    return cfg, envs, model, collector


def plain_ppo_grads(agent, rollout, cfg) -> list[torch.Tensor]:
    """The gradient of the same PPO loss with plain autograd: one graph over the whole sequence."""
    data = rollout.data
    T, N = data.batch_size
    agent.zero_grad(set_to_none=True)
    heads, _ = plain_sequence(agent, data, rollout.start_state, cfg.collector.bptt_truncate)
    advantage, returns, _ = gae_targets(data, gamma=cfg.loss.gamma, gae_lambda=cfg.loss.gae_lambda)
    batch = heads.update(
        TensorDict(
            old_log_prob=data["log_prob"],
            old_value=data["value"],
            advantage=advantage,
            valid=data["valid"],
            **{"return": returns},
            batch_size=[T, N],
        )
    )
    total_loss(PPO.loss(batch, cfg)).backward()
    return [p.grad.detach().clone() for p in agent.parameters()]


# ------------------------------------------------------------------ gradient parity
@pytest.mark.parametrize("block_steps", [1, 7], ids=["steps1", "steps7"])
@pytest.mark.parametrize("agent", [GRU, MLP], ids=["gru", "mlp"])
def test_ppo_gradient_equals_plain_autograd_over_the_stored_rollout(agent, block_steps):
    # block_steps 7: 60 rows in blocks of 7 (the last of 4), episode starts inside blocks.
    cfg, envs, model, collector = make_setup(
        agent, extra=("ppo.epochs=1", "ppo.num_minibatches=1", f"replay.block_steps={block_steps}")
    )
    reference = copy.deepcopy(model)
    recorder = GradRecorder(model.parameters())
    algo = PPO(cfg, collector, model, recorder)
    collector.collect()  # a second rollout starts from a carried, nonzero state
    rollout = collector.collect()
    data = rollout.data
    assert not data["value"].requires_grad
    # The rollout holds an episode end (termination), a truncation and autoreset rows.
    assert data["terminated"].any() and data["truncated"].any() and not data["valid"].all()
    if agent is GRU:
        assert rollout.start_state["h"].abs().sum() > 0
    metrics, _ = algo.optimize(rollout)
    assert len(recorder.grads) == 1 and metrics["train/epochs_run"] == 1
    assert metrics["train/clipfrac"] == 0
    if block_steps == 1:
        assert metrics["train/approx_kl"] == 0  # the collector's call, replayed: ratio exactly 1
    else:
        # A block is one call over 7 steps' rows where the collector made one call per step; the
        # math library may round a matmul differently by its row count (seen with MKL: the GRU on
        # AVX-512, the MLP with AVX2 forced), so the ratio is 1 up to float rounding, not bit for bit.
        assert abs(metrics["train/approx_kl"]) < 1e-7
    expected = plain_ppo_grads(reference, rollout, cfg)
    names = [n for n, _ in model.named_parameters()]
    assert all(g.abs().sum() > 0 for g in expected)
    assert_grads_match(
        dict(zip(names, recorder.grads[0])),
        dict(zip(names, expected)),
        f"ppo-{'gru' if agent is GRU else 'mlp'}",
        rtol=1e-5,
        atol=1e-6,
    )
    envs.close()


def test_bptt_truncate_cuts_the_replayed_gradient():
    # Truncating every step leaves the first encoder weights only the gradient of the
    # current step; the full-sequence gradient differs.
    grads = {}
    for k in ("null", "1"):
        cfg, envs, model, collector = make_setup(
            extra=("ppo.epochs=1", "ppo.num_minibatches=1", f"collector.bptt_truncate={k}")
        )
        recorder = GradRecorder(model.parameters())
        PPO(cfg, collector, model, recorder).update()
        grads[k] = recorder.grads[0]
        envs.close()
    assert not torch.allclose(grads["null"][0], grads["1"][0])


# ------------------------------------------------------------------ minibatches
def test_minibatches_hold_whole_sequences_from_the_stored_start_state(monkeypatch):
    cfg, envs, model, collector = make_setup(num_envs=6, num_steps=20, extra=("ppo.epochs=2", "ppo.num_minibatches=3"))
    seen = []
    real = ppo_module.replay_sequence

    def recording(policy, data, start_state, acc, bptt, block_steps=1):
        out = real(policy, data, start_state, acc, bptt, block_steps=block_steps)
        seen.append((data.clone(), start_state.clone(), out["log_prob"].detach().clone()))
        return out

    monkeypatch.setattr(ppo_module, "replay_sequence", recording)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    algo = PPO(cfg, collector, model, optimizer)
    algo.update()
    seen.clear()
    state_before = collector._state.clone()
    rollout = algo.update().rollout
    assert (rollout.start_state == state_before).all() and state_before["h"].abs().sum() > 0
    data = rollout.data
    assert len(seen) == 2 * 3
    for epoch in range(2):
        covered = []
        for k in range(3):
            mb, start, log_prob = seen[epoch * 3 + k]
            assert mb.batch_size == torch.Size([20, 2])  # whole T-step sequences of N/M envs
            envs_of_mb = []
            for j in range(2):
                matches = [i for i in range(6) if torch.equal(data["observation"][:, i], mb["observation"][:, j])]
                assert len(matches) == 1
                i = matches[0]
                envs_of_mb.append(i)
                assert torch.equal(mb["action"][:, j], data["action"][:, i])
                assert torch.equal(start["h"][j], rollout.start_state["h"][i])
            covered += envs_of_mb
            if epoch == 0 and k == 0:  # parameters not yet stepped: the stored log-probs again
                torch.testing.assert_close(log_prob, data["log_prob"][:, envs_of_mb], rtol=1e-5, atol=1e-6)
        assert sorted(covered) == list(range(6))  # every env once per epoch
    envs.close()


def test_target_kl_stops_the_epochs():
    runs = {}
    for target in ("null", "1.0e-9"):
        cfg, envs, model, collector = make_setup(
            num_steps=16, extra=("ppo.epochs=4", "ppo.num_minibatches=2", f"ppo.target_kl={target}")
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        runs[target] = PPO(cfg, collector, model, optimizer).update().metrics
        envs.close()
    assert runs["null"]["train/epochs_run"] == 4
    # The first epoch's last minibatch already moved the policy more than 1e-9.
    assert runs["1.0e-9"]["train/epochs_run"] == 1


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("block_steps", [1, 16])
def test_saved_bytes_grow_linearly_in_T_and_no_graph_outlives_a_minibatch(monkeypatch, block_steps):
    accumulators: list[weakref.ref] = []
    alive_at_start: list[int] = []

    class Tracked(ppo_module.GradientAccumulator):
        def __init__(self):
            # No gc.collect(): the graph must be freed by reference counting, not by a later
            # cycle collection.
            alive_at_start.append(sum(r() is not None for r in accumulators))
            super().__init__()
            accumulators.append(weakref.ref(self))

    monkeypatch.setattr(ppo_module, "GradientAccumulator", Tracked)
    saved = {}
    for T in (16, 32, 64):
        cfg, envs, model, collector = make_setup(
            num_steps=T, extra=("ppo.epochs=2", "ppo.num_minibatches=2", f"replay.block_steps={block_steps}")
        )
        algo = PPO(cfg, collector, model, torch.optim.Adam(model.parameters(), lr=1e-3))
        saved[T] = algo.update().metrics["memory/replay_saved_bytes"]
        envs.close()
    gc.collect()
    # Each minibatch's blocks (and the accumulator their graph holds) are gone before the next.
    assert len(alive_at_start) == 3 * 2 * 2 and alive_at_start == [0] * 12
    assert all(r() is None for r in accumulators)
    # Block inputs of a 2-env minibatch: per step observation (2 x 4 float32) and is_first
    # (2 bool); per block the state it starts from, h (2 x 16 float32).
    per_step, per_block = 2 * 4 * 4 + 2, 2 * 16 * 4
    assert saved == {T: T * per_step + (T // block_steps) * per_block for T in (16, 32, 64)}


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, match",
    [
        (["env.num_envs=6", "ppo.num_minibatches=4"], r"'ppo.num_minibatches' \(4\) must divide 'env.num_envs' \(6\)"),
        (["loss.baseline=false"], "loss.baseline"),
        (["ppo.epochs=0"], "ppo.epochs"),
        (["ppo.clip_coef=0"], "ppo.clip_coef"),
        (["ppo.target_kl=-0.1"], "ppo.target_kl"),
        (["ppo.num_minibatches=0"], "ppo.num_minibatches"),
    ],
)
def test_ppo_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["loss.algorithm=ppo", *overrides])


def test_ppo_section_defaults_follow_cleanrl_and_are_ignored_by_a2c():
    cfg = load_config(None, ["loss.algorithm=ppo"])
    p = cfg.ppo
    assert (p.epochs, p.num_minibatches, p.clip_coef, p.clip_vloss, p.target_kl) == (4, 4, 0.2, True, None)
    # loss.normalize_advantages unset: PPO normalises per minibatch.
    assert cfg.loss.normalize_advantages is None and PPO.normalize_advantages(cfg.loss) is True
    # a2c does not read the ppo section: an env count it does not divide is fine there.
    assert load_config(None, ["env.num_envs=6"]).loss.algorithm == "a2c"


# ------------------------------------------------------------------ trainer
def test_trainer_runs_ppo_and_logs_its_metrics(tmp_path):
    from rl_replay.run.setup import build

    cfg = load_config(
        None,
        [
            "loss.algorithm=ppo",
            "env.num_envs=4",
            "collector.num_steps=16",
            "ppo.num_minibatches=2",
            "ppo.epochs=2",
            "agent.target=gru",
            "agent.kwargs={hidden_size: 16, encoder_sizes: [16]}",
            "env.id=rl_replay/POCartPole-v0",
            "total_env_steps=192",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={tmp_path / 'run'}",
            "optim.name=adam",
            "optim.lr=3e-4",
        ],
    )
    trainer = build(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train()
    assert trainer.update == 3 and trainer.env_steps == 192
    for key in (
        "train/approx_kl",
        "train/clipfrac",
        "train/explained_variance",
        "train/epochs_run",
        "train/loss_policy",
        "train/loss_value",
        "train/entropy",
        "train/grad_norm",
        "time/collect_sec",
        "time/optimize_sec",
        "memory/replay_saved_bytes",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["train/epochs_run"] == 2
    after = trainer.model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert Path(tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 3


# ------------------------------------------------------------------ FSDP
def _fsdp_ppo_worker(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rl_replay.distributed import init_from_env, wrap_fsdp

    info, device = init_from_env("cpu", "gloo")
    results = {}
    cfg = ppo_cfg(4, 40, "ppo.epochs=1", "ppo.num_minibatches=1")
    envs = make_vector_env("CartPole-v1", 4, max_episode_steps=25)
    torch.manual_seed(0)  # identical initialisation on every rank
    agent = build_agent(GRU[0], GRU[1], envs.single_observation_space, envs.single_action_space)
    reference = copy.deepcopy(agent)
    model = wrap_fsdp(agent, device, wrap_modules=["Linear"])
    assert len(FSDP.fsdp_modules(model)) > 1
    torch.manual_seed(1 + rank)  # action sampling differs per rank
    collector = Collector(envs, model, num_steps=40, seed=100 + 1000 * rank)
    recorder = GradRecorder(model.parameters(), fsdp_model=model)
    rollout = PPO(cfg, collector, model, recorder, info=info, device=device).update().rollout
    assert len(recorder.grads) == 1
    local = plain_ppo_grads(reference, rollout, cfg)
    names = [n for n, _ in reference.named_parameters()]
    mean, differs = {}, False
    for name, grad in zip(names, local):
        both = [torch.empty_like(grad) for _ in range(world_size)]
        dist.all_gather(both, grad)
        differs |= not torch.allclose(both[0], both[1], rtol=1e-3, atol=1e-5)
        mean[name] = torch.stack(both).mean(0)
    results["fsdp"] = dict(zip(names, recorder.grads[0]))
    # The same rollout in multi-step blocks (7 steps, the last of 5): FSDP's stepwise path.
    recorder7 = GradRecorder(model.parameters(), fsdp_model=model)
    PPO(
        ppo_cfg(4, 40, "ppo.epochs=1", "ppo.num_minibatches=1", "replay.block_steps=7"),
        collector,
        model,
        recorder7,
        info=info,
        device=device,
    ).optimize(rollout)
    results["fsdp_steps7"] = dict(zip(names, recorder7.grads[0]))
    results["mean"] = mean
    results["differs"] = differs
    results["boundaries"] = bool(rollout.data["terminated"].any() and rollout.data["truncated"].any())
    # target_kl: the ranks agree on when to stop (a rank leaving alone would deadlock FSDP).
    epochs = {}
    for target in ("null", "1.0e-9"):
        cfg_kl = ppo_cfg(4, 40, "ppo.epochs=3", "ppo.num_minibatches=2", f"ppo.target_kl={target}")
        algo = PPO(cfg_kl, collector, model, torch.optim.Adam(model.parameters(), lr=1e-2), info=info, device=device)
        ran = torch.tensor([algo.update().metrics["train/epochs_run"]])
        gathered = [torch.empty_like(ran) for _ in range(world_size)]
        dist.all_gather(gathered, ran)
        epochs[target] = [float(x) for x in gathered]
    results["epochs"] = epochs
    envs.close()
    if rank == 0:
        torch.save(results, Path(out_dir) / "fsdp_ppo.pt")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_rank_fsdp_ppo_matches_single_process_gradient(tmp_path):
    from _dist import run_ranks

    run_ranks(_fsdp_ppo_worker, str(tmp_path))
    r = torch.load(tmp_path / "fsdp_ppo.pt", weights_only=False)
    assert r["differs"], "both ranks produced the same gradient: the parity check would be vacuous"
    assert r["boundaries"], "rank 0's rollout has no termination or no truncation"
    assert_grads_match(r["fsdp"], r["mean"], "ppo-fsdp", rtol=1e-5, atol=1e-6)
    assert_grads_match(r["fsdp_steps7"], r["mean"], "ppo-fsdp", rtol=1e-5, atol=1e-6)
    assert r["epochs"] == {"null": [3.0, 3.0], "1.0e-9": [1.0, 1.0]}


# ------------------------------------------------------------------ loss
def test_ppo_loss_matches_cleanrl_formulas_and_ignores_invalid_rows():
    g = torch.Generator().manual_seed(0)
    T, n = 6, 5
    new_lp, old_lp = torch.randn(T, n, generator=g) * 0.3, torch.randn(T, n, generator=g) * 0.3
    value, old_value = torch.randn(T, n, generator=g), torch.randn(T, n, generator=g)
    adv, ret, ent = torch.randn(T, n, generator=g), torch.randn(T, n, generator=g), torch.rand(T, n, generator=g)
    valid = torch.ones(T, n, dtype=torch.bool)
    valid[2, 1] = valid[4, 3] = False
    garbage = lambda x: torch.where(valid, x, torch.nan)  # noqa: E731
    batch = TensorDict(
        log_prob=garbage(new_lp),
        entropy=garbage(ent),
        value=garbage(value),
        old_log_prob=old_lp,
        old_value=old_value,
        advantage=adv,
        valid=valid,
        **{"return": ret},
        batch_size=[T, n],
    )
    terms = ppo_loss(batch, clip_coef=0.2, clip_vloss=True, value_coef=0.5, entropy_coef=0.01)
    # CleanRL ppo.py on the valid rows (b_ = flattened batch).
    lr, ratio = (new_lp - old_lp)[valid], (new_lp - old_lp)[valid].exp()
    a = adv[valid]
    a = (a - a.mean()) / (a.std() + 1e-8)
    pg = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
    v, r, ov = value[valid], ret[valid], old_value[valid]
    v_clipped = ov + (v - ov).clamp(-0.2, 0.2)
    v_loss = 0.5 * torch.max((v - r) ** 2, (v_clipped - r) ** 2).mean()
    torch.testing.assert_close(terms["loss_policy"], pg)
    torch.testing.assert_close(terms["loss_value"], 0.5 * v_loss)
    torch.testing.assert_close(terms["loss_entropy"], -0.01 * ent[valid].mean())
    torch.testing.assert_close(terms["approx_kl"], ((ratio - 1) - lr).mean())
    torch.testing.assert_close(terms["clipfrac"], ((ratio - 1).abs() > 0.2).float().mean())
    assert all(torch.isfinite(terms[k]) for k in terms.keys())
