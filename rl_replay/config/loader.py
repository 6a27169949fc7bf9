"""Loading a config: YAML files, command-line overrides, type checks and validation.

Precedence when loading: dataclass defaults < YAML file (on its ``base:`` files) < command-line
overrides. Reading and parsing the files is :mod:`rl_replay.config.yaml_files`'s job.

    cfg = load_config("configs/memory_gru.yaml", ["optim.lr=3e-4", "env.kwargs.delay=32"])

Overrides have the form ``section.key=value`` (or ``key=value`` for root fields such as
``seed``). Values are parsed as YAML, so ``3e-4``, ``true``, ``null``, ``[64, 64]`` and
``{delay: 64}`` all work. A dotted path that continues into a dict field
(``env.kwargs.delay=64``) sets one key inside that dict instead of replacing it.

Every field is type-checked; enumerated strings and numeric ranges are validated, and
every error is a ``ValueError`` that names the offending key (``FileNotFoundError`` for a
missing file). The schema itself is :mod:`rl_replay.config.schema`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from rl_replay._compat import translate_block_steps, translate_norm_adv
from rl_replay.config.schema import ALGORITHM_NAMES, Config
from rl_replay.config.yaml_files import (
    file_layers,
    key_text,
    parse,
    yaml_load,
    yaml_problem,
)
from rl_replay.errors import shown
from rl_replay.targets import canonical_target, is_short_name, parse_target

__all__ = [
    "load_config",
    "loads_config",
    "dump_config",
    "config_from_dict",
    "config_to_dict",
    "validate",
    "type_name",
]

# --------------------------------------------------------------------------------------
# Validation tables (dotted key -> constraint)
# --------------------------------------------------------------------------------------

_CHOICES: dict[str, tuple[Any, ...]] = {
    "device": ("cpu", "cuda", "auto"),
    "env.vectorization": ("sync", "async", "vector_entry_point", "envpool"),
    "collector.mode": ("fixed", "episode"),
    "loss.algorithm": ALGORITHM_NAMES,
    "loss.entropy_schedule": ("constant", "linear", "exponential"),
    "optim.name": ("adam", "rmsprop", "sgd"),
    "log.wandb_mode": ("offline", "online", "disabled"),
    "distributed.mixed_precision": (None, "bf16", "fp16"),
    "distributed.backend": ("auto", "gloo", "nccl"),
    "distributed.sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
    "distributed.collect_gathered": ("auto", "true", "false"),
    "distributed.fsdp_version": (1, 2),
}

#: Upper bounds on sizes. A config may come from someone else's run, and a size far past any
#: real run's allocates before anything can check it (``torch_threads: 100000`` aborts in the
#: allocator; ``collector.num_steps: 1e9`` grows memory for minutes). The memory a run's agent
#: and rollout will need is estimated against the machine's before building (``run.setup``).
MAX_THREADS = 1024
MAX_ENVS = 1 << 16
MAX_STEPS = 1 << 24  # per rollout; episode mode stops there too
MAX_COUNT = 1 << 62  # env steps, seeds, episode lengths: what an int64 counter holds
MAX_PASSES = 10_000  # PPO epochs over one rollout
MAX_EPISODES = 1_000_000  # evaluation episodes

#: How deeply a config's free-form values (``agent.kwargs``, ``env.kwargs``, wrapper kwargs) may
#: nest. A checkpoint stores the config inside its own tree, which nests a few levels more and is
#: refused past ``safe_tree.MAX_DEPTH``: a config accepted here always writes back readable.
MAX_VALUE_DEPTH = 16

# (lower, lower_inclusive, upper, upper_inclusive); None bounds are open. A None value of
# an Optional field is always accepted ("when set").
_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "seed": (0, True, MAX_COUNT, True),
    "total_env_steps": (1, True, MAX_COUNT, True),
    "torch_threads": (1, True, MAX_THREADS, True),
    "env.num_envs": (1, True, MAX_ENVS, True),
    "env.max_episode_steps": (1, True, MAX_COUNT, True),
    "collector.num_steps": (1, True, MAX_STEPS, True),
    "collector.bptt_truncate": (1, True, MAX_STEPS, True),
    "replay.block_steps": (1, True, MAX_STEPS, True),
    "loss.gamma": (0, True, 1, True),
    "loss.gae_lambda": (0, True, 1, True),
    "loss.entropy_coef": (0, True, None, False),
    "loss.entropy_coef_final": (0, True, None, False),
    "loss.entropy_decay_env_steps": (1, True, None, False),
    "ppo.epochs": (1, True, MAX_PASSES, True),
    "ppo.num_minibatches": (1, True, MAX_STEPS, True),
    "ppo.clip_coef": (0, False, None, False),
    "ppo.target_kl": (0, False, None, False),
    "optim.lr": (0, False, None, False),
    "optim.max_grad_norm": (0, False, None, False),
    "optim.skip_nonfinite_updates": (0, True, None, False),
    "log.log_every": (1, True, None, False),
    "log.horizon_every": (0, True, None, False),
    "checkpoint.every": (0, True, None, False),
    "eval.episodes": (1, True, MAX_EPISODES, True),
    "eval.every": (0, True, None, False),
    "distributed.min_num_params": (1, True, None, False),
}


# --------------------------------------------------------------------------------------
# Type helpers
# --------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    base, optional = _split_optional(tp)
    name = getattr(typing.get_origin(base) or base, "__name__", str(base))
    return f"{name} | None" if optional else name


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Type-check one leaf value; returns it (ints converted to float for float fields)."""
    base, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
    elif base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    else:
        container = typing.get_origin(base) or base
        if isinstance(value, container):
            return container(value)  # shallow copy; elements are not checked
    raise ValueError(
        f"Invalid type for config key '{key}': expected {type_name(tp)}, got {type(value).__name__} {shown(value)}"
    )


def _unknown_key(key: str, section: str | None, valid: Sequence[str]) -> ValueError:
    where = f"in '{section}'" if section else "at top level"
    return ValueError(f"Unknown config key '{key_text(key)}'. Valid keys {where}: {', '.join(valid)}")


def _unknown_section(name: str, key: str) -> ValueError:
    sections = [k for k, tp in _hints(Config).items() if _is_section(tp)]
    return ValueError(
        f"Unknown config section '{key_text(name)}' (in '{key_text(key)}'). Valid sections: {', '.join(sections)}"
    )


# --------------------------------------------------------------------------------------
# Building and validating
# --------------------------------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"Config section '{prefix}' must be a mapping, got {type(data).__name__} {shown(data)}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            raise _unknown_key(f"{prefix}.{k}" if prefix else str(k), prefix or None, names)
    hints = _hints(cls)
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        value = data[name]
        if _is_section(tp):
            kwargs[name] = _build(tp, {} if value is None else value, key)
        else:
            kwargs[name] = _check_value(key, value, tp)
    return cls(**kwargs)


def _iter_leaves(obj: Any, prefix: str = ""):
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if _is_section(hints[f.name]):
            yield from _iter_leaves(value, key)
        else:
            yield key, value, hints[f.name]


def validate(cfg: Config) -> Config:
    """Check types, enumerated values and ranges of a config; raises ValueError.

    Returns ``cfg`` unchanged so it can be used inline.
    """
    values = {}
    for key, value, tp in _iter_leaves(cfg):
        _check_value(key, value, tp)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"Non-finite value for config key '{key}': {shown(value)} (must be a finite number)")
        if _nesting(value) > MAX_VALUE_DEPTH:
            raise ValueError(
                f"Config key '{key}' nests deeper than {MAX_VALUE_DEPTH} levels: a config holds no such value"
            )
        values[key] = value
    for key, allowed in _CHOICES.items():
        if values[key] not in allowed:
            choices = ", ".join("null" if a is None else str(a) for a in allowed)
            raise ValueError(f"Invalid value for config key '{key}': {shown(values[key])}. Allowed: {choices}")
    for key, (lo, lo_inc, hi, hi_inc) in _RANGES.items():
        v = values[key]
        if v is None:
            continue
        ok = True
        if lo is not None:
            ok = ok and (v >= lo if lo_inc else v > lo)
        if hi is not None:
            ok = ok and (v <= hi if hi_inc else v < hi)
        if not ok or (isinstance(v, float) and math.isnan(v)):
            lo_s = "" if lo is None else f"{lo} {'<=' if lo_inc else '<'} "
            hi_s = "" if hi is None else f" {'<=' if hi_inc else '<'} {hi}"
            raise ValueError(f"Out of range value for config key '{key}': {shown(v)} (must be {lo_s}{key}{hi_s})")
    if not is_short_name(cfg.agent.target):  # a short name is looked up when the agent is built
        _check_target("agent.target", cfg.agent.target, "(expected a built-in name such as 'gru', or 'module:Class')")
    _check_str_list("env.imports", cfg.env.imports)
    _check_str_list("env.observation_keys", cfg.env.observation_keys)
    _check_str_list("log.tags", cfg.log.tags)
    for i, spec in enumerate(cfg.env.wrappers):
        key = f"env.wrappers[{i}]"
        form = "(expected {target: 'module:Class', kwargs: {...}})"
        if not isinstance(spec, Mapping):
            raise ValueError(f"Invalid value for config key '{key}': {shown(spec)} {form}")
        unknown = sorted(set(spec) - {"target", "kwargs"})
        if unknown:
            raise ValueError(f"Unknown key {shown(unknown[0])} in config key '{key}': {form}")
        if not isinstance(spec.get("target"), str) or not spec["target"]:
            raise ValueError(f"Config key '{key}.target' must be a string 'module:Class' {form}")
        _check_target(f"{key}.target", spec["target"], form)
        if not isinstance(spec.get("kwargs") or {}, Mapping):
            raise ValueError(f"Config key '{key}.kwargs' must be a mapping, got {shown(spec['kwargs'])}")
    if cfg.loss.algorithm == "ppo":
        _validate_ppo(cfg)
    _validate_entropy_schedule(cfg.loss)
    if cfg.distributed.wrap_modules and cfg.distributed.min_num_params is not None:
        raise ValueError(
            "Config keys 'distributed.wrap_modules' and 'distributed.min_num_params' "
            "are mutually exclusive: set at most one"
        )
    return cfg


def _nesting(value: Any, depth: int = 0) -> int:
    """How deeply ``value`` nests (lists and mappings), counted no further than one past the limit."""
    if depth > MAX_VALUE_DEPTH or not isinstance(value, (list, tuple, Mapping)):
        return depth
    items = value.values() if isinstance(value, Mapping) else value
    return max((_nesting(v, depth + 1) for v in items), default=depth + 1)


def _validate_ppo(cfg: Config) -> None:
    n, m = cfg.env.num_envs, cfg.ppo.num_minibatches
    if n % m:
        raise ValueError(
            f"Config key 'ppo.num_minibatches' ({m}) must divide 'env.num_envs' ({n}): each PPO "
            "minibatch holds the whole sequences of num_envs / num_minibatches envs"
        )
    if not cfg.loss.baseline:
        raise ValueError("Config key 'loss.baseline' applies to reinforce; PPO always trains its critic")


def _validate_entropy_schedule(loss: Any) -> None:
    if loss.entropy_schedule == "exponential" and (loss.entropy_coef <= 0 or loss.entropy_coef_final <= 0):
        raise ValueError(
            "Config key 'loss.entropy_schedule' is exponential, which multiplies the weight by a constant "
            f"factor per env step: 'loss.entropy_coef' ({shown(loss.entropy_coef)}) and 'loss.entropy_coef_final' "
            f"({shown(loss.entropy_coef_final)}) must both be > 0 (use linear to decay to 0)"
        )


def _check_target(key: str, value: str, form: str) -> None:
    try:
        parse_target(value, key)
    except ValueError:
        raise ValueError(f"Invalid value for config key '{key}': {shown(value)} {form}") from None


def _check_str_list(key: str, value: list) -> None:
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ValueError(f"Invalid value for config key '{key}[{i}]': {shown(item)} (expected a non-empty string)")


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a (possibly partial) nested dict."""
    return validate(_build(Config, data, ""))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain-dict copy of ``cfg`` (YAML-serialisable)."""
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------
# Loading: defaults < file < overrides
# --------------------------------------------------------------------------------------


def _merge_file(data: dict[str, Any], loaded: Any, path: str, *, deep: bool = False) -> None:
    """Merge one source's sections into ``data``. ``deep`` (a file over its ``base:``): a dict
    value (``env.kwargs``) is merged key by key into the base's instead of replacing it, except
    that an ``agent.target`` other than the base's drops the base's ``agent.kwargs``."""
    if loaded is None:  # empty file
        return
    if not isinstance(loaded, Mapping):
        raise ValueError(f"Config file {path!r} must contain a mapping at top level, got {type(loaded).__name__}")
    loaded = translate_norm_adv(loaded, data["loss"]["algorithm"], path)
    loaded = translate_block_steps(loaded, data["loss"]["algorithm"], path)
    hints = _hints(Config)
    for k, v in loaded.items():
        if k not in hints:
            if isinstance(v, Mapping):
                raise _unknown_section(str(k), str(k))
            raise _unknown_key(str(k), None, list(hints))
        if _is_section(hints[k]):
            if v is None:  # a section with every key commented out
                continue
            if not isinstance(v, Mapping):
                raise ValueError(
                    f"Config section '{k}' in {path!r} must be a mapping, got {type(v).__name__} {shown(v)}"
                )
            section_names = list(_hints(hints[k]))
            if deep and k == "agent" and "target" in v and not _same_agent(v["target"], data[k]["target"]):
                # The base's agent.kwargs were written for its agent.target: another target
                # starts from this file's kwargs alone, as an override of the target does.
                data[k]["kwargs"] = {}
            for sk, sv in v.items():
                if sk not in section_names:
                    raise _unknown_key(f"{k}.{sk}", k, section_names)
                if deep and isinstance(sv, Mapping) and isinstance(data[k].get(sk), Mapping):
                    data[k][sk] = _deep_merge(data[k][sk], sv)
                else:
                    data[k][sk] = sv
        else:
            data[k] = v


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
        )
    return out


_OVERRIDE_FORM = "expected 'section.key=value' (or 'key=value' for a top-level key), e.g. 'optim.lr=3e-4'"


def _apply_override(data: dict[str, Any], override: str) -> None:
    if not isinstance(override, str) or "=" not in override:
        raise ValueError(f"Malformed override {shown(override)}: {_OVERRIDE_FORM}")
    key, raw = override.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ValueError(f"Malformed override {shown(override)}: {_OVERRIDE_FORM}")
    try:
        value = yaml_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"Cannot parse value of override {shown(override)} as YAML: {yaml_problem(e)}") from None

    if key in ("ppo.norm_adv", "ppo.block_steps", "collector.block_steps"):  # retired: read as in a file
        section, _, name = key.partition(".")  # (rl_replay._compat.translate_norm_adv / translate_block_steps)
        _merge_file(data, {section: {name: value}}, f"override {shown(override)}")
        return
    root = _hints(Config)
    head = parts[0]
    if head not in root:
        if len(parts) > 1:
            raise _unknown_section(head, key)
        err = _unknown_key(head, None, list(root))
        homes = [s for s, t in root.items() if _is_section(t) and head in _hints(t)]
        if homes:
            err = ValueError(f"{err} (did you mean {' or '.join(f'{h}.{head}' for h in homes)}?)")
        raise err
    tp = root[head]
    container, name, rest = data, head, parts[1:]
    if _is_section(tp) and rest:
        section_hints = _hints(tp)
        name, rest = rest[0], rest[1:]
        if name not in section_hints:
            raise _unknown_key(f"{head}.{name}", head, list(section_hints))
        container, tp = data[head], section_hints[name]

    if _is_section(tp):  # whole section, e.g. env={id: CartPole-v1, num_envs: 4}
        if not isinstance(value, Mapping):
            raise ValueError(
                f"Override of section '{head}' needs a mapping value, got {shown(value)}; "
                f"or set one key: '{head}.<key>=value'"
            )
        _merge_file(data, {head: value}, "override")
        return

    base, _ = _split_optional(tp)
    if rest:  # path continues into a dict field: set one key inside the dict
        dotted = ".".join(parts[: len(parts) - len(rest)])
        if (typing.get_origin(base) or base) is not dict:
            raise ValueError(f"Config key '{dotted}' has type {type_name(tp)}, not dict: cannot set '{key}'")
        node = container.get(name)
        if node is None:
            node = container[name] = {}
        for i, p in enumerate(rest[:-1]):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                sub = ".".join([dotted, *rest[: i + 1]])
                raise ValueError(f"Cannot set '{key}': '{sub}' is {shown(child)}, not a mapping")
            node = child
        node[rest[-1]] = value
        return

    # A string field given something YAML reads as a number/bool (run_name=001) keeps the text.
    if base is str and isinstance(value, (int, float, bool)):
        value = raw.strip()
    container[name] = value


# A config is a page of YAML; a file far larger is not one (and is not read whole).
def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a Config: dataclass defaults, then the YAML file (if any), then overrides.

    A file may start from another: ``base: other.yaml`` (a path relative to the file) loads that
    file first, and this one then says only the keys that differ (a dict value such as
    ``env.kwargs`` merges key by key into the base's; a list such as ``env.wrappers`` replaces
    it; an ``agent.target`` other than the base's starts from this file's ``agent.kwargs`` alone).
    Bases may have bases, at most :data:`MAX_BASE_DEPTH` deep, without a cycle.

    An override of ``agent.target`` (to another class) drops the file's ``agent.kwargs``:
    they were written for the file's target. ``agent.kwargs`` overrides still apply.

    Raises FileNotFoundError if ``path`` (or a base) does not exist and ValueError for unknown
    keys, wrong types, invalid values, malformed overrides, a key given twice in one mapping,
    YAML anchors or aliases, a ``base:`` cycle, and a path that is not a regular file of at
    most 1 MiB.
    """
    if path is None:
        return loads_config(None, overrides)
    layers = file_layers(os.fspath(path), ())
    return _config_from_layers(layers, overrides)


#: How many ``base:`` files a config may stand on.
def loads_config(text: str | bytes | None, overrides: Sequence[str] = (), *, source: str = "<config>") -> Config:
    """:func:`load_config` of the YAML ``text`` (None: no file); ``source`` names it in errors.

    Text has no place to resolve a ``base:`` from: a run's ``config.yaml`` holds every key.
    """
    layers = []
    if text is not None:
        loaded = parse(text, source)
        if isinstance(loaded, Mapping) and "base" in loaded:
            raise ValueError(
                f"Config {source!r} has a 'base' key, which only a config file given by its path may use "
                "(a run's config.yaml holds every key itself)"
            )
        layers.append((loaded, source))
    return _config_from_layers(layers, overrides)


def _config_from_layers(layers: list[tuple[Any, str]], overrides: Sequence[str]) -> Config:
    if isinstance(overrides, str):  # a single override passed by mistake
        overrides = [overrides]
    data = config_to_dict(Config())
    for i, (loaded, source) in enumerate(layers):
        _merge_file(data, loaded, source, deep=i > 0)
    loaded = copy.deepcopy(data)
    for ov in overrides:
        _apply_override(data, ov)
    if not _same_agent(data["agent"]["target"], loaded["agent"]["target"]):
        # The file's agent.kwargs were written for its agent.target (default.yaml's
        # hidden_sizes for the MLP): another target gets only the command line's kwargs.
        data = loaded
        data["agent"]["kwargs"] = {}
        for ov in overrides:
            _apply_override(data, ov)
    return config_from_dict(data)


def _same_agent(a: Any, b: Any) -> bool:
    """Whether two ``agent.target`` values name one class (``gru`` and ``agents.gru:GRUAgent`` do)."""
    if canonical_target(a) == canonical_target(b):
        return True
    from rl_replay.agent import canonical_agent_target  # the short names' table; imports torch

    return canonical_agent_target(a) == canonical_agent_target(b)


def dump_config(cfg: Config) -> str:
    """``cfg`` as YAML text (what a run directory's ``config.yaml`` holds)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
