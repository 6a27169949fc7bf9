"""Tests for rl_replay.config: defaults, YAML files, overrides, validation, save/load, derived sizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from rl_replay.config import (
    AgentConfig,
    Config,
    batch_size_per_rank,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    num_updates,
    validate,
)
from rl_replay.errors import SetupError
from rl_replay.run.setup import check_distributed_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
YAML_FILES = sorted(CONFIG_DIR.glob("*.yaml")) + sorted(CONFIG_DIR.glob("*.yml"))


# ----------------------------------------------------------------------------- defaults


def test_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.seed == 1 and cfg.device == "cpu" and cfg.total_env_steps == 500_000
    assert cfg.run_dir is None
    assert cfg.env.id == "CartPole-v1" and cfg.env.num_envs == 8 and cfg.env.vectorization == "sync"
    assert cfg.env.kwargs == {} and cfg.env.max_episode_steps is None
    assert cfg.agent.target == "mlp" and cfg.agent.kwargs == {}
    assert (cfg.collector.mode, cfg.collector.num_steps, cfg.collector.bptt_truncate) == ("fixed", 5, None)
    assert cfg.loss.algorithm == "a2c" and cfg.loss.gamma == 0.99 and cfg.loss.gae_lambda == 1.0
    assert (cfg.loss.value_coef, cfg.loss.entropy_coef) == (0.5, 0.0)
    assert cfg.loss.normalize_advantages is None and cfg.loss.baseline is True
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.eps, cfg.optim.max_grad_norm) == ("rmsprop", 7e-4, 1e-5, 0.5)
    assert cfg.optim.anneal_lr is True
    assert cfg.log.wandb_mode == "offline" and cfg.log.wandb_project == "rl_replay"
    assert cfg.log.wandb_entity is None and cfg.log.run_name is None
    assert cfg.log.progress is True and cfg.log.log_every == 1
    assert cfg.checkpoint.every == 50
    assert cfg.eval.episodes == 10 and cfg.eval.deterministic is True
    d = cfg.distributed
    assert (d.wrap_modules, d.min_num_params, d.cpu_offload, d.mixed_precision, d.backend) == (
        [],
        None,
        False,
        None,
        "auto",
    )


def test_mutable_defaults_are_not_shared():
    a, b = Config(), Config()
    a.env.kwargs["x"] = 1
    a.distributed.wrap_modules.append("Block")
    assert b.env.kwargs == {} and b.distributed.wrap_modules == []


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import rl_replay.config.schema as mod

    tree = ast.parse(inspect.getsource(mod))
    checked = 0
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ), f"{node.name}.{stmt.target.id} has no docstring"
                checked += 1
    assert checked == sum(len(dataclasses.fields(c)) for c in _all_config_classes())


def _all_config_classes():
    classes, todo = [], [Config]
    while todo:
        c = todo.pop()
        classes.append(c)
        todo += [f.default_factory for f in dataclasses.fields(c) if dataclasses.is_dataclass(f.default_factory)]
    return classes


# ----------------------------------------------------------------------------- YAML files


def test_config_dir_has_the_expected_files():
    names = {p.name for p in YAML_FILES}
    assert {
        "default.yaml",
        "memory_gru.yaml",
        "ppo_cartpole.yaml",
        "ppo_pocartpole_gru.yaml",
        "ppo_memory_gru.yaml",
        "fsdp_transformer.yaml",
    } <= names
    assert "pocartpole_gru.yaml" not in names  # A2C on the masked CartPole never learned: retired


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_yaml_in_configs_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert validate(cfg) is cfg
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict)
    # every explicitly set scalar leaf is what we loaded (1.0e-3 style floats included); a file on
    # a base: says only what differs, and a dict it gives merges into the base's
    base = load_config(CONFIG_DIR / raw.pop("base")) if "base" in raw else None
    for section, body in raw.items():
        if isinstance(body, dict):
            for key, value in body.items():
                got = getattr(getattr(cfg, section), key)
                if (
                    base is not None
                    and isinstance(value, dict)
                    and not (section == "agent" and key == "kwargs" and cfg.agent.target != base.agent.target)
                ):
                    assert got == {**getattr(getattr(base, section), key), **value}, f"{section}.{key}"
                else:
                    assert got == value, f"{section}.{key}"
        else:
            assert getattr(cfg, section) == body, section


def test_a_config_on_a_base_says_only_what_differs(tmp_path):
    (tmp_path / "a.yaml").write_text(
        "seed: 3\nenv: {id: CartPole-v1, num_envs: 4, kwargs: {x: 1, y: 2}}\noptim: {lr: 0.1}\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nenv: {num_envs: 8, kwargs: {y: 3}}\n")
    cfg = load_config(tmp_path / "sub" / "b.yaml", ["optim.lr=0.2"])
    assert (cfg.seed, cfg.env.num_envs, cfg.env.kwargs, cfg.optim.lr) == (3, 8, {"x": 1, "y": 3}, 0.2)
    # another agent.target starts from the file's own agent.kwargs: the base's were written for its agent
    (tmp_path / "a.yaml").write_text("agent: {target: gru, kwargs: {hidden_size: 64, head_sizes: [8]}}\n")
    (tmp_path / "same.yaml").write_text("base: a.yaml\nagent: {kwargs: {hidden_size: 32}}\n")
    (tmp_path / "other.yaml").write_text("base: a.yaml\nagent: {target: lru, kwargs: {head_sizes: [16]}}\n")
    assert load_config(tmp_path / "same.yaml").agent.kwargs == {"hidden_size": 32, "head_sizes": [8]}
    other = load_config(tmp_path / "other.yaml").agent
    assert (other.target, other.kwargs) == ("lru", {"head_sizes": [16]})
    (tmp_path / "a.yaml").write_text("base: sub/b.yaml\n")
    with pytest.raises(ValueError, match=r"a base: cycle"):
        load_config(tmp_path / "sub" / "b.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml"):
        load_config(tmp_path / "c.yaml")
    from rl_replay.config import loads_config

    with pytest.raises(ValueError, match=r"only a config file given by its path may use"):
        loads_config("base: a.yaml\n")  # a run's config.yaml holds every key: no base to read


def test_default_yaml_matches_dataclass_defaults():
    cfg = load_config(CONFIG_DIR / "default.yaml")
    expected = Config(agent=AgentConfig(kwargs={"hidden_sizes": [64, 64]}))
    assert cfg == expected


def test_agent_kwargs_go_only_to_the_target_they_were_written_for():
    default = CONFIG_DIR / "default.yaml"  # agent: {target: mlp, kwargs: {hidden_sizes: [64, 64]}}
    assert load_config(default, ["agent.target=my_pkg:MyAgent"]).agent == AgentConfig("my_pkg:MyAgent", {})
    # the command line's own kwargs stay, before or after the target
    for overrides in (
        ["agent.target=gru", "agent.kwargs.hidden_size=8"],
        ["agent.kwargs.hidden_size=8", "agent.target=gru"],
        ["agent={target: gru, kwargs: {hidden_size: 8}}"],
    ):
        assert load_config(default, overrides).agent == AgentConfig("gru", {"hidden_size": 8}), overrides
    # the same class under another name keeps them
    memory = CONFIG_DIR / "memory_gru.yaml"
    kept = load_config(memory).agent.kwargs
    assert kept and load_config(memory, ["agent.target=agents.gru:GRUAgent"]).agent.kwargs == kept
    assert load_config(default, ["agent.target=mlp"]).agent.kwargs == {"hidden_sizes": [64, 64]}
    # a file that names its own target gets its own kwargs, and nothing of the defaults
    assert load_config(memory, ["agent.target=lstm"]).agent == AgentConfig("lstm", {})


def test_memory_gru_yaml():
    cfg = load_config(CONFIG_DIR / "memory_gru.yaml")
    assert cfg.env.id == "rl_replay/MemoryCue-v0" and cfg.env.kwargs == {"delay": 64}
    assert cfg.env.num_envs == 32
    assert cfg.agent.target == "gru" and cfg.agent.kwargs == {"hidden_size": 128, "update_gate_bias": 5.0}
    assert cfg.collector.mode == "episode"
    assert cfg.collector.num_steps == cfg.env.kwargs["delay"] + 2 == 66
    assert cfg.total_env_steps == 2_000_000
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)


def test_pocartpole_and_fsdp_yaml():
    po = load_config(CONFIG_DIR / "ppo_pocartpole_gru.yaml")
    assert po.env.id == "rl_replay/POCartPole-v0" and po.agent.target == "gru"
    assert (po.loss.algorithm, po.collector.mode) == ("ppo", "fixed")
    fs = load_config(CONFIG_DIR / "fsdp_transformer.yaml")
    assert fs.agent.target == "transformer"
    assert fs.agent.kwargs == {"d_model": 256, "num_layers": 4, "num_heads": 4}
    assert fs.distributed.wrap_modules == ["TransformerEncoderLayer"] and fs.distributed.cpu_offload is False


TORCHRUN_YAML = [p for p in YAML_FILES if "torchrun" in p.read_text().split("\n\n")[0]]


def test_torchrun_configs_are_found():
    assert {p.name for p in TORCHRUN_YAML} >= {"fsdp_transformer.yaml", "fsdp_gtrxl_memory_1024.yaml"}


@pytest.mark.parametrize("path", TORCHRUN_YAML, ids=lambda p: p.name)
def test_torchrun_configs_pass_the_distributed_checks(path):
    # a config whose header says to launch it with torchrun must not be refused under torchrun
    # (fsdp_gtrxl_memory_1024.yaml once inherited eval.every and log.horizon_every from its base)
    check_distributed_config(load_config(path))


def test_distributed_checks_refuse_eval_and_horizon():
    cfg = load_config(CONFIG_DIR / "fsdp_transformer.yaml")
    check_distributed_config(cfg)
    with pytest.raises(SetupError, match=r"eval\.every is not supported under torchrun.*eval\.every=0"):
        check_distributed_config(load_config(CONFIG_DIR / "fsdp_transformer.yaml", ["eval.every=5"]))
    with pytest.raises(SetupError, match=r"log\.horizon_every is not supported under torchrun"):
        check_distributed_config(load_config(CONFIG_DIR / "fsdp_transformer.yaml", ["log.horizon_every=3"]))


def test_file_then_overrides_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 7\noptim:\n  lr: 5.0e-4\n  name: sgd\n")
    cfg = load_config(p, ["optim.lr=2e-4"])
    assert cfg.seed == 7 and cfg.optim.name == "sgd" and cfg.optim.lr == 2e-4
    assert cfg.optim.eps == 1e-5  # untouched keys keep their defaults


def test_empty_file_and_empty_section_give_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    assert load_config(p) == Config()
    p.write_text("optim:\n  # lr: 1.0\n")
    assert load_config(p) == Config()


def test_scientific_notation_without_dot_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 3e-4\n")
    assert load_config(p).optim.lr == pytest.approx(3e-4)


# ----------------------------------------------------------------------------- overrides


def test_overrides_of_each_kind():
    cfg = load_config(
        overrides=[
            "optim.lr=3e-4",  # float (no dot: YAML 1.1 would read a string)
            "loss.gamma=1",  # int accepted for a float field, stored as float
            "env.num_envs=4",  # int
            "optim.anneal_lr=true",  # bool
            "collector.bptt_truncate=null",  # null for an Optional field
            "optim.max_grad_norm=null",
            "distributed.wrap_modules=[Block, Head]",  # list
            "agent.kwargs={hidden_sizes: [32, 32]}",  # dict
            "seed=42",  # root key
            "env.id=rl_replay/MemoryCue-v0",  # string with slash
        ]
    )
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.loss.gamma == 1.0 and isinstance(cfg.loss.gamma, float)
    assert cfg.env.num_envs == 4
    assert cfg.optim.anneal_lr is True
    assert cfg.collector.bptt_truncate is None and cfg.optim.max_grad_norm is None
    assert cfg.distributed.wrap_modules == ["Block", "Head"]
    assert cfg.agent.kwargs == {"hidden_sizes": [32, 32]}
    assert cfg.seed == 42
    assert cfg.env.id == "rl_replay/MemoryCue-v0"


def test_nested_dict_key_override_merges_into_dict():
    cfg = load_config(CONFIG_DIR / "memory_gru.yaml", ["env.kwargs.delay=8", "env.kwargs.noise=0.1"])
    assert cfg.env.kwargs == {"delay": 8, "noise": 0.1}
    cfg = load_config(overrides=["env.kwargs.delay=64"])
    assert cfg.env.kwargs == {"delay": 64}
    cfg = load_config(overrides=["agent.kwargs.a.b=1"])  # intermediate dicts are created
    assert cfg.agent.kwargs == {"a": {"b": 1}}


def test_later_override_wins_and_whole_dict_replaces():
    cfg = load_config(overrides=["env.kwargs.delay=64", "env.kwargs={x: 1}", "seed=2", "seed=3"])
    assert cfg.env.kwargs == {"x": 1} and cfg.seed == 3


def test_whole_section_override():
    cfg = load_config(overrides=["collector={mode: episode, num_steps: 10}"])
    assert (cfg.collector.mode, cfg.collector.num_steps) == ("episode", 10)


def test_string_field_keeps_override_text():
    cfg = load_config(overrides=["log.run_name=001", "log.wandb_entity=true"])
    assert cfg.log.run_name == "001" and cfg.log.wandb_entity == "true"


def test_value_containing_equals_sign():
    cfg = load_config(overrides=["log.run_name=a=b"])
    assert cfg.log.run_name == "a=b"


# ----------------------------------------------------------------------------- rejections


def test_unknown_section():
    with pytest.raises(ValueError, match=r"Unknown config section 'foo'.*Valid sections: env, agent"):
        load_config(overrides=["foo.bar=1"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(
        ValueError,
        match=r"Unknown config key 'optim\.lrr'\. Valid keys in 'optim': name, lr, eps, max_grad_norm, anneal_lr, skip_nonfinite_updates$",
    ):
        load_config(overrides=["optim.lrr=1"])


def test_unknown_root_key_suggests_section():
    with pytest.raises(ValueError, match=r"Unknown config key 'lr'.*did you mean optim\.lr"):
        load_config(overrides=["lr=0.1"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("seed=true", r"'seed': expected int, got bool True"),  # bool is not an int
        ("optim.lr=true", r"'optim\.lr': expected float, got bool"),  # ... nor a float
        ("env.num_envs=2.5", r"'env\.num_envs': expected int, got float 2\.5"),
        ("env.num_envs=null", r"'env\.num_envs': expected int, got NoneType None"),  # not Optional
        ("optim.max_grad_norm=abc", r"'optim\.max_grad_norm': expected float \| None, got str 'abc'"),
        ("env.kwargs=[1, 2]", r"'env\.kwargs': expected dict, got list"),
        ("distributed.wrap_modules=Block", r"'distributed\.wrap_modules': expected list, got str 'Block'"),
        ("loss.normalize_advantages=1", r"'loss\.normalize_advantages': expected bool \| None, got int 1"),
    ],
)
def test_wrong_type(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    "override, key",
    [
        ("env.vectorization=threads", "env.vectorization"),
        ("collector.mode=window", "collector.mode"),
        ("loss.algorithm=sac", "loss.algorithm"),
        ("optim.name=lion", "optim.name"),
        ("log.wandb_mode=cloud", "log.wandb_mode"),
        ("distributed.mixed_precision=fp8", "distributed.mixed_precision"),
        ("distributed.backend=mpi", "distributed.backend"),
        ("device=tpu", "device"),
    ],
)
def test_bad_enum(override, key):
    value = override.split("=", 1)[1]
    with pytest.raises(ValueError, match=rf"'{key}': '{value}'\. Allowed: "):
        load_config(overrides=[override])


def test_fsdp_version_is_1_or_2():
    assert load_config().distributed.fsdp_version == 1
    assert load_config(overrides=["distributed.fsdp_version=2"]).distributed.fsdp_version == 2
    with pytest.raises(ValueError, match=r"'distributed.fsdp_version': 3\. Allowed: 1, 2"):
        load_config(overrides=["distributed.fsdp_version=3"])


def test_enum_accepts_each_allowed_value():
    assert load_config(overrides=["distributed.mixed_precision=bf16"]).distributed.mixed_precision == "bf16"
    assert load_config(overrides=["device=auto"]).device == "auto"
    assert load_config(overrides=["collector.mode=episode"]).collector.mode == "episode"


@pytest.mark.parametrize(
    "override, key, shown",
    [
        ("env.num_envs=0", "env.num_envs", "0"),
        ("collector.num_steps=0", "collector.num_steps", "0"),
        ("loss.gamma=1.5", "loss.gamma", "1.5"),
        ("loss.gamma=-0.1", "loss.gamma", "-0.1"),
        ("loss.gae_lambda=2", "loss.gae_lambda", "2.0"),
        ("optim.lr=0", "optim.lr", "0.0"),
        ("optim.lr=-1e-3", "optim.lr", "-0.001"),
        ("collector.bptt_truncate=0", "collector.bptt_truncate", "0"),
        ("total_env_steps=0", "total_env_steps", "0"),
        ("checkpoint.every=-1", "checkpoint.every", "-1"),
        ("log.log_every=0", "log.log_every", "0"),
        ("eval.episodes=0", "eval.episodes", "0"),
    ],
)
def test_out_of_range(override, key, shown):
    with pytest.raises(ValueError, match=rf"Out of range value for config key '{key}': {shown} "):
        load_config(overrides=[override])


def test_range_boundaries_are_accepted():
    cfg = load_config(
        overrides=["loss.gamma=0", "loss.gae_lambda=1", "checkpoint.every=0", "collector.bptt_truncate=1"]
    )
    assert (cfg.loss.gamma, cfg.loss.gae_lambda, cfg.checkpoint.every, cfg.collector.bptt_truncate) == (0.0, 1.0, 0, 1)


def test_bad_agent_target():
    with pytest.raises(ValueError, match=r"'agent\.target'.*module:Class"):
        load_config(overrides=["agent.target=Not-A-Name"])


def test_wrap_modules_and_min_num_params_exclusive():
    with pytest.raises(ValueError, match=r"mutually exclusive"):
        load_config(overrides=["distributed.wrap_modules=[Block]", "distributed.min_num_params=1000"])


@pytest.mark.parametrize("override", ["optim.lr", "", "=3", "optim..lr=1"])
def test_malformed_override(override):
    with pytest.raises(ValueError, match=r"Malformed override .*expected 'section\.key=value'"):
        load_config(overrides=[override])


def test_dotted_path_into_non_dict_field():
    with pytest.raises(ValueError, match=r"'seed' has type int, not dict"):
        load_config(overrides=["seed.x=1"])
    with pytest.raises(ValueError, match=r"'env\.kwargs\.a' is 1, not a mapping"):
        load_config(overrides=["env.kwargs={a: 1}", "env.kwargs.a.b=2"])


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_config(missing)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("optimizer:\n  lr: 0.1\n", r"Unknown config section 'optimizer'"),
        ("env:\n  num_env: 4\n", r"Unknown config key 'env\.num_env'\. Valid keys in 'env': id, num_envs"),
        ("total_env_steps: lots\n", r"'total_env_steps': expected int, got str 'lots'"),
        ("- a\n- b\n", r"must contain a mapping at top level, got list"),
        ("env: CartPole-v1\n", r"section 'env'.*must be a mapping"),
    ],
    ids=["unknown-section", "unknown-key", "wrong-type", "list-at-top", "section-not-mapping"],
)
def test_bad_file_is_rejected_naming_the_problem(tmp_path, text, pattern):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        load_config(p)


def test_validate_rejects_bad_direct_construction():
    cfg = Config()
    cfg.env.num_envs = True
    with pytest.raises(ValueError, match=r"'env\.num_envs': expected int, got bool"):
        validate(cfg)


# ----------------------------------------------------------------------------- save / load


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(
        CONFIG_DIR / "memory_gru.yaml",
        ["optim.lr=3e-5", "log.run_name=001", "distributed.mixed_precision=bf16", "env.kwargs.extra=[1, 2]"],
    )
    out = tmp_path / "config.yaml"
    out.write_text(dump_config(cfg))
    assert load_config(out) == cfg
    assert yaml.safe_load(out.read_text()) == config_to_dict(cfg)


def test_config_to_dict_is_a_deep_copy_and_round_trips():
    cfg = load_config(CONFIG_DIR / "default.yaml")
    d = config_to_dict(cfg)
    assert d["agent"]["kwargs"] == {"hidden_sizes": [64, 64]} and d["optim"]["lr"] == 7e-4
    d["agent"]["kwargs"]["hidden_sizes"].append(1)
    assert cfg.agent.kwargs == {"hidden_sizes": [64, 64]}
    assert config_from_dict(config_to_dict(cfg)) == cfg


# ----------------------------------------------------------------------------- derived


def test_batch_size_and_num_updates_count_every_rank():
    assert batch_size_per_rank(Config()) == 8 * 5
    assert num_updates(Config(), world_size=1) == 12500  # 500000 / 40
    cfg = load_config(overrides=["env.num_envs=4", "collector.num_steps=32", "total_env_steps=1024"])
    assert batch_size_per_rank(cfg) == 128
    assert num_updates(cfg, world_size=1) == 8  # exact division
    assert num_updates(cfg, world_size=2) == 4  # every rank runs 4 envs: an update takes 256 steps
    assert num_updates(cfg, world_size=3) == 3  # 1024 / 384 rounds up
    cfg = load_config(overrides=["env.num_envs=4", "collector.num_steps=32", "total_env_steps=1025"])
    assert num_updates(cfg, world_size=2) == 5  # rounds up
    mem = load_config(CONFIG_DIR / "memory_gru.yaml")
    assert batch_size_per_rank(mem) == 32 * 66
    assert num_updates(mem, world_size=4) == -(-2_000_000 // (4 * 32 * 66))


def test_pocartpole_yaml_wrappers_rescale_observations_and_keep_raw_returns():
    """The shipped masked-CartPole config's wrappers: observations in [-2, 2], rewards
    normalised for the learner, raw CartPole returns in the episode statistics."""
    import envs  # noqa: F401  (registers rl_replay/POCartPole-v0)
    from rl_replay.rollout.environment import make_vector_env

    po = load_config(CONFIG_DIR / "ppo_pocartpole_gru.yaml")
    assert [w["target"] for w in po.env.wrappers] == [
        "gymnasium.wrappers:RescaleObservation",
        "gymnasium.wrappers:NormalizeReward",
    ]
    assert po.env.wrappers[1]["kwargs"]["gamma"] == po.loss.gamma
    vec = make_vector_env(po.env.id, 2, wrappers=po.env.wrappers)
    try:
        assert list(vec.single_observation_space.low) == [-2.0, -2.0]
        obs, _ = vec.reset(seed=0)
        rewards, raw = [], []
        for _ in range(200):
            obs, reward, term, trunc, info = vec.step(vec.action_space.sample())
            assert abs(obs).max() <= 2.0
            rewards.extend(reward.tolist())
            for _key, value in info.items():
                if isinstance(value, dict) and "r" in value:
                    mask = value.get("_r", [True] * len(value["r"]))
                    raw.extend(float(r) for r, m in zip(value["r"], mask) if m)
        assert any(r != 1.0 for r in rewards)  # the learner sees normalised rewards
        assert raw and all(r == int(r) and r >= 8 for r in raw)  # episodes' own returns
    finally:
        vec.close()


# ------------------------------------------- collector.block_steps / ppo.block_steps in old configs
def test_the_old_block_steps_keys_are_read_as_replay_block_steps(tmp_path):
    """Each old key was read by its own algorithms only, and a saved run config holds both."""
    from rl_replay.config import config_to_dict

    for algorithm, read in (("ppo", 7), ("a2c", 3), ("reinforce", 3)):
        data = config_to_dict(load_config(None, [f"loss.algorithm={algorithm}"]))
        del data["replay"]
        data["collector"]["block_steps"], data["ppo"]["block_steps"] = 3, 7  # an old RUN_DIR/config.yaml
        path = tmp_path / f"old_{algorithm}.yaml"
        path.write_text(yaml.safe_dump(data))
        cfg = load_config(path)
        assert cfg.replay.block_steps == read, algorithm
        assert not hasattr(cfg.collector, "block_steps") and not hasattr(cfg.ppo, "block_steps")
    assert load_config(None, ["loss.algorithm=ppo", "ppo.block_steps=5"]).replay.block_steps == 5
    assert load_config(None, ["collector.block_steps=1"]).replay.block_steps == 1
    assert (
        load_config(None, ["loss.algorithm=ppo", "collector.block_steps=1"]).replay.block_steps == 16
    )  # PPO never read it
    path = tmp_path / "both.yaml"
    path.write_text("loss: {algorithm: ppo}\nppo: {block_steps: 8}\nreplay: {block_steps: 4}\n")
    with pytest.raises(
        ValueError, match=r"'ppo\.block_steps: 8' and 'replay\.block_steps: 4'.*keep the value you mean"
    ):
        load_config(path)
    path.write_text("loss: {algorithm: ppo}\nppo: {block_steps: 8}\nreplay: {block_steps: 8}\n")
    assert load_config(path).replay.block_steps == 8
