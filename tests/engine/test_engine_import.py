"""The engine stands alone: importing it loads torch and tensordict, not the trainer side."""

import json
import subprocess
import sys

# What importing the engine must not pull in: the trainer's third-party dependencies and
# every rl_replay module outside rl_replay.engine.
FORBIDDEN_THIRD_PARTY = ("gymnasium", "wandb", "yaml")  # (tensordict itself brings tqdm)


def _modules_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_engine_loads_no_trainer_module():
    loaded = _modules_after("import rl_replay.engine")
    assert "rl_replay.engine.replay" in loaded and "tensordict" in loaded
    third_party = [m for m in loaded if m.split(".")[0] in FORBIDDEN_THIRD_PARTY]
    ours = [
        m for m in loaded if m.startswith("rl_replay") and m != "rl_replay" and not m.startswith("rl_replay.engine")
    ]
    assert third_party == [] and ours == []


def test_the_package_reexports_the_engine_without_the_trainer():
    loaded = _modules_after("import rl_replay; rl_replay.replay, rl_replay.GradientAccumulator")
    assert [m for m in loaded if m.split(".")[0] in FORBIDDEN_THIRD_PARTY] == []
    import rl_replay
    import rl_replay.engine as engine

    assert rl_replay.replay is engine.replay
    assert rl_replay.GradientAccumulator is engine.GradientAccumulator
    assert rl_replay.ReplayError is engine.ReplayError


def test_the_trainer_side_does_load_when_asked():
    # The check above can fail: rl_replay.Agent brings gymnasium in.
    loaded = _modules_after("import rl_replay; rl_replay.Agent")
    assert "gymnasium" in loaded and "rl_replay.agent" in loaded
