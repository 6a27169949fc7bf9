"""POPGym's score for trained runs, one row per environment, and an aggregate over environments.

For each run directory: **MMER** as Morad et al. (ICLR 2023) report it, the maximum over training
of the mean return of the last 100 training episodes (stochastic policy; the trainer's
``rollout/return_recent``, counted once 100 episodes have ended, as RLlib's
``episode_reward_mean`` over 100 episodes). RLlib reports that mean once per training iteration,
one 65,536-step batch in the paper, so the maximum is taken at the same cadence: at the first update
at or past each multiple of ``--report-every`` env steps (65,536; 0 reads every update, whose more
frequent and noisier means bias a maximum upwards). With ``--greedy-episodes N`` the mean return of N
greedy episodes of the final checkpoint (``scripts/evaluate.py``). Per environment: the mean over
its runs (seeds), beside the paper's GRU and best model. Across environments: the interquartile
mean (IQM) of all runs' MMER with a 95 % stratified-bootstrap interval (runs resampled within each
environment), computed by ``rliable`` (Agarwal et al., NeurIPS 2021; the ``[rliable]`` extra; every env
needs as many runs), and with ``--profile`` its performance profile.

    python scripts/tools/popgym_table.py runs/popgym/* --greedy-episodes 100 --json out.json --plot out.png --profile profile.png

Runs are grouped by their config's ``env.id``; a row is one recipe's seeds, so runs of one env whose
configs differ in anything but the seed, the run directory, the budget and logging, checkpointing or
evaluation settings are refused (run the tool once per recipe). A run whose config you did not write
evaluates under the same rules as ``scripts/evaluate.py`` (``--trust-config`` passes on).

A table outlives its run directories: ``--with T.json`` (a table this tool wrote) brings in its rows
for the envs none of the given runs is of, so a row run again replaces its earlier one and the
aggregate is taken over them all (``docs/popgym_table.json`` holds the shipped configs' table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

#: The paper's MMER (Appendix B, 15M env steps, mean of 3 trials): (GRU, best model, its score).
PAPER = {
    "popgym-RepeatFirstHard-v0": (0.940, "IndRNN", 0.969),
    "popgym-RepeatPreviousMedium-v0": (-0.315, "LMU", 0.789),
    "popgym-RepeatPreviousHard-v0": (-0.428, "LMU", 0.191),
    "popgym-CountRecallEasy-v0": (0.177, "LSTM", 0.509),
    "popgym-AutoencodeEasy-v0": (-0.283, "GRU", -0.283),
    "popgym-MultiarmedBanditEasy-v0": (0.619, "Elman", 0.631),
    "popgym-NoisyPositionOnlyCartPoleMedium-v0": (0.642, "IndRNN", 0.659),
    "popgym-HigherLowerEasy-v0": (0.529, "GRU", 0.529),
    "popgym-PositionOnlyCartPoleHard-v0": (1.000, "GRU", 1.000),
}

WINDOW = 100  # episodes in the mean the MMER maximises over
REPORT_EVERY = 65_536  # env steps per RLlib training iteration in the paper (its train batch)


def mmer(records: list[dict], report_every: int = REPORT_EVERY) -> float | None:
    """Max over training of the mean return of the last 100 training episodes, from the first
    record at which 100 episodes have ended (None if a run never got there), read at the first
    record at or past each multiple of ``report_every`` env steps (0: every record)."""
    ended, best, next_report = 0.0, None, report_every
    for r in records:
        ended += r.get("rollout/episodes") or 0.0
        if report_every:
            if r["env_steps"] < next_report:
                continue
            next_report = (r["env_steps"] // report_every + 1) * report_every
        value = r.get("rollout/return_recent")
        if ended >= WINDOW and value is not None:
            best = value if best is None else max(best, value)
    return best


RLIABLE_EXTRA = "pip install -e '.[rliable]'"


def _rliable():
    """rliable's ``library`` and ``metrics`` modules, or ``None`` when the extra is not installed."""
    try:
        from rliable import library, metrics
    except ImportError:
        return None
    return library, metrics


def score_matrix(strata: list[np.ndarray]) -> np.ndarray:
    """The runs x envs matrix rliable takes; ValueError (one line) unless every env has as many runs."""
    counts = [s.size for s in strata]
    if len(set(counts)) != 1:
        raise ValueError(
            f"the aggregate needs the same number of runs of every env (rliable's scores are a runs x envs "
            f"matrix); these envs have {', '.join(map(str, counts))} runs"
        )
    return np.stack(strata, axis=1)


def iqm(scores: np.ndarray) -> float:
    """rliable's IQM (``metrics.aggregate_iqm``: ``scipy.stats.trim_mean(scores, 0.25, axis=None)``)
    computed the same way, partition then mean, without scipy's per-call array-API wrapper, which
    is most of a 50,000-sample bootstrap's time."""
    flat = np.ravel(np.asarray(scores, dtype=float))
    low = int(0.25 * flat.size)
    return float(np.mean(np.partition(flat, (low, flat.size - low - 1))[low : flat.size - low]))


def iqm_interval(matrix: np.ndarray, reps: int = 50_000, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """rliable's IQM of every score and its 95 % stratified-bootstrap percentile interval (runs
    resampled within each env), seeded."""
    library, _ = _rliable()  # type: ignore[misc]
    import warnings

    # rliable's StratifiedBootstrap draws its resamples from numpy's global generator
    # (np.random.choice in update_indices), not from random_state: seed that for the call and put
    # the caller's state back, so the interval is the same for the same data in any process.
    outside = np.random.get_state()
    np.random.seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*random_state is deprecated.*", category=FutureWarning)
            point, interval = library.get_interval_estimates(
                {"x": matrix},
                lambda scores: np.array([iqm(scores)]),
                reps=reps,
                random_state=np.random.RandomState(seed),
            )
    finally:
        np.random.set_state(outside)
    lo, hi = interval["x"][:, 0]
    return float(point["x"][0]), (float(lo), float(hi))


#: Config keys (dotted prefixes) that may differ between the runs of one row.
PER_RUN = ("seed", "run_dir", "total_env_steps", "torch_threads", "log.", "checkpoint.", "eval.")


def run_config(run: Path):
    """The run's config, read through the run directory's door as data (nothing imported)."""
    from rl_replay.rundir.door import RunDirectory

    with RunDirectory.open(run) as opened:
        return opened.config(build=False).cfg


def run_metrics(run: Path) -> list[dict]:
    """The run's metrics rows through the door (no link followed, lines bounded); a cut last
    line is skipped with a note on stderr."""
    from rl_replay.errors import one_line
    from rl_replay.rundir.door import read_run_metrics

    notes: list[str] = []
    records = read_run_metrics(run, notes)
    for note in notes:
        print(one_line(note), file=sys.stderr)
    return records


def env_id(run: Path) -> str:
    """The run's ``env.id``."""
    return run_config(run).env.id


def _recipe(cfg) -> dict[str, object]:
    from rl_replay.config import config_to_dict

    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value and prefix.count(".") < 3:
            for key, sub in value.items():
                walk(f"{prefix}{key}.", sub)
        else:
            flat[prefix.rstrip(".")] = value

    walk("", config_to_dict(cfg))
    return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p) for p in PER_RUN)}


def check_one_recipe_per_env(runs: list[Path]) -> None:
    """Refuse runs of one env whose recipes differ: a row's mean is over one recipe's seeds."""
    first: dict[str, tuple[Path, dict[str, object]]] = {}
    for run in runs:
        cfg = run_config(run)
        env, recipe = cfg.env.id, _recipe(cfg)
        if env not in first:
            first[env] = (run, recipe)
            continue
        other, seen = first[env]
        differ = sorted(k for k in set(seen) | set(recipe) if seen.get(k) != recipe.get(k))
        if differ:
            raise SystemExit(
                f"popgym_table: {other} and {run} are both {env} but their configs differ in "
                f"{', '.join(differ)}: a row is one recipe's seeds. Run the tool once per recipe."
            )


def greedy_return(run: Path, episodes: int, trust: bool) -> float:
    """The mean return of ``episodes`` greedy episodes of ``run``'s checkpoint (scripts/evaluate.py)."""
    cmd = [sys.executable, str(REPO / "scripts" / "evaluate.py"), str(run), "--episodes", str(episodes)]
    if trust:
        cmd.append("--trust-config")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"popgym_table: evaluating {run} failed: {out.stderr.strip()[-400:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["return_mean"])


def env_row(env: str, rows: list[dict]) -> dict:
    """One environment's row: its runs, their mean MMER and greedy return, the paper's scores."""
    scored = [r["mmer"] for r in rows if r["mmer"] is not None]
    greedy = [r["greedy"] for r in rows if r.get("greedy") is not None]
    gru, best_name, best = PAPER.get(env, (None, None, None))
    return {
        "env": env,
        "runs": rows,
        "mmer": float(np.mean(scored)) if scored else None,
        "greedy": float(np.mean(greedy)) if greedy else None,
        "paper_gru": gru,
        "paper_best": best,
        "paper_best_model": best_name,
    }


def aggregate(envs: list[dict], reps: int = 50_000) -> dict | None:
    """rliable's IQM of every run's MMER over ``envs`` with its stratified-bootstrap interval, and the
    paper's per-env means over the same envs (None when no run has an MMER). ``note`` instead, when
    rliable is not installed or the envs have unequal numbers of runs."""
    strata = [np.array([r["mmer"] for r in e["runs"] if r["mmer"] is not None]) for e in envs]
    strata = [s for s in strata if s.size]
    if not strata:
        return None
    if _rliable() is None:
        return {"note": f"the aggregate needs rliable: {RLIABLE_EXTRA}"}
    try:
        matrix = score_matrix(strata)
    except ValueError as exc:
        return {"note": str(exc)}
    point, interval = iqm_interval(matrix, reps=reps)
    _, metrics = _rliable()  # type: ignore[misc]
    result: dict = {
        "iqm": point,
        "ci95": interval,
        "envs": len(strata),
        # A stratum of one run resamples to itself: the interval carries none of that env's
        # seed-to-seed spread, so it is too narrow by an unknown amount (reported, not hidden).
        "single_run_envs": sum(1 for s in strata if s.size == 1),
    }
    paper = [[PAPER[e["env"]][0], PAPER[e["env"]][2]] for e in envs if e["env"] in PAPER and e["mmer"] is not None]
    if paper:  # the paper's per-env means over the same envs (its trials are not published)
        result["paper_gru_iqm"] = float(metrics.aggregate_iqm(np.array([p[0] for p in paper])))
        result["paper_best_iqm"] = float(metrics.aggregate_iqm(np.array([p[1] for p in paper])))
    return result


def performance_profile(result: dict, out: str) -> None:
    """rliable's performance profile: the fraction of runs whose MMER exceeds each threshold, with
    its 95 % stratified-bootstrap band, beside the paper's GRU and best model (one mean per env)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rliable import library, plot_utils

    strata = [np.array([r["mmer"] for r in e["runs"] if r["mmer"] is not None]) for e in result["envs"]]
    scores = {"rl_replay": score_matrix([s for s in strata if s.size])}
    paper = [e for e in result["envs"] if e["env"] in PAPER and e["mmer"] is not None]
    if paper:
        scores["paper GRU (mean per env)"] = np.array([[PAPER[e["env"]][0] for e in paper]])
        scores["paper best (mean per env)"] = np.array([[PAPER[e["env"]][2] for e in paper]])
    taus = np.linspace(-1.0, 1.0, 81)
    profiles, bands = library.create_performance_profile(scores, taus, reps=2_000)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_utils.plot_performance_profiles(
        profiles, taus, performance_profile_cis=bands, xlabel="MMER threshold", ax=ax, legend=True
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def table(
    runs: list[Path],
    greedy_episodes: int = 0,
    trust: bool = False,
    report_every: int = REPORT_EVERY,
    earlier: list[dict] | None = None,
    reps: int = 50_000,
) -> dict:
    """Per-run and per-environment rows and the aggregate (see the module's docstring; ``reps``
    bootstrap samples); the rows of ``earlier`` (env rows of tables this tool wrote) join for the
    envs none of ``runs`` is of."""
    by_env: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        records = run_metrics(run)
        row = {
            "run": str(run),
            "mmer": mmer(records, report_every),
            "env_steps": records[-1]["env_steps"] if records else 0,
            "greedy": greedy_return(run, greedy_episodes, trust) if greedy_episodes else None,
        }
        by_env[env_id(run)].append(row)
    rows = {env: env_row(env, env_runs) for env, env_runs in by_env.items()}
    for e in earlier or []:
        if e["env"] not in rows:  # a row run again replaces the earlier one
            rows[e["env"]] = {**env_row(e["env"], e["runs"]), "greedy": e.get("greedy")}
    envs = [rows[env] for env in sorted(rows)]
    return {"envs": envs, "aggregate": aggregate(envs, reps), "report_every": report_every}


def read_earlier(path: Path, report_every: int) -> list[dict]:
    """The env rows of a table this tool wrote with ``--json``, checked before anything runs."""
    where = f"popgym_table: --with {path}"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{where}: not a table this tool wrote ({err}); pass the file --json wrote") from None
    envs = data.get("envs") if isinstance(data, dict) else None
    if not isinstance(envs, list) or not all(
        isinstance(e, dict) and isinstance(e.get("env"), str) and isinstance(e.get("runs"), list) for e in envs
    ):
        raise SystemExit(f"{where}: no 'envs' list of rows with 'env' and 'runs'; pass the file --json wrote")
    for e in envs:
        for r in e["runs"]:
            if not isinstance(r, dict) or not (r.get("mmer") is None or isinstance(r["mmer"], (int, float))):
                raise SystemExit(f"{where}: a run of {e['env']} has no numeric 'mmer'; pass the file --json wrote")
    if data.get("report_every") != report_every:
        raise SystemExit(
            f"{where}: its MMER was read every {data.get('report_every')} env steps, this table's every "
            f"{report_every}: a maximum over a different cadence is not comparable (pass --report-every "
            f"{data.get('report_every')} or rebuild that table from its runs)"
        )
    return envs


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(result: dict) -> str:
    lines = [
        "| env | runs | MMER (ours) | greedy (ours) | paper GRU | paper best |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for e in result["envs"]:
        name = e["env"].removeprefix("popgym-").removesuffix("-v0")
        best = f"{e['paper_best_model']} {_fmt(e['paper_best'])}" if e["paper_best_model"] else "-"
        lines.append(
            f"| {name} | {len(e['runs'])} | {_fmt(e['mmer'])} | {_fmt(e['greedy'])} | {_fmt(e['paper_gru'])} | {best} |"
        )
    every = result.get("report_every")
    lines.append(f"\nMMER read {f'every {every:,} env steps' if every else 'at every update'}")
    agg = result["aggregate"]
    if agg and "note" in agg:
        lines.append(f"\nno aggregate: {agg['note']}")
    elif agg:
        lo, hi = agg["ci95"]
        lines.append(
            f"\nIQM of MMER over {agg['envs']} envs: {agg['iqm']:.3f} (95 % CI {lo:.3f} to {hi:.3f}; rliable, "
            "stratified bootstrap)"
        )
        if agg.get("single_run_envs"):
            lines.append(
                f"{agg['single_run_envs']} of the {agg['envs']} envs have one run, which the bootstrap cannot "
                "resample: the interval leaves out their seed-to-seed spread and is too narrow (run >= 2 seeds each)"
            )
        if "paper_gru_iqm" in agg:
            lines.append(
                f"the paper's per-env means over the same envs: GRU {agg['paper_gru_iqm']:.3f}, best model "
                f"{agg['paper_best_iqm']:.3f}"
            )
    return "\n".join(lines)


def plot(result: dict, out: str) -> None:
    """Per-env MMER (runs as dots, the mean as a bar) beside the paper's GRU and best model, and the IQM with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = result["envs"]
    fig, (ax, agg_ax) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [5, 1]})
    x = np.arange(len(envs))
    ax.bar(x - 0.25, [e["mmer"] or 0 for e in envs], 0.25, label="rl_replay (mean of runs)")
    for i, e in enumerate(envs):
        pts = [r["mmer"] for r in e["runs"] if r["mmer"] is not None]
        ax.scatter([i - 0.25] * len(pts), pts, color="k", s=8, zorder=3)
    ax.bar(x, [e["paper_gru"] or 0 for e in envs], 0.25, label="paper GRU")
    ax.bar(x + 0.25, [e["paper_best"] or 0 for e in envs], 0.25, label="paper best of 13")
    ax.set_xticks(x, [e["env"].removeprefix("popgym-").removesuffix("-v0") for e in envs], rotation=30, ha="right")
    ax.set_ylabel("MMER")
    ax.set_ylim(-1, 1)
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    agg = result["aggregate"]
    if agg and "iqm" in agg:
        lo, hi = agg["ci95"]
        agg_ax.errorbar([0], [agg["iqm"]], yerr=[[agg["iqm"] - lo], [hi - agg["iqm"]]], fmt="o", capsize=4)
        if "paper_gru_iqm" in agg:
            agg_ax.scatter([1, 2], [agg["paper_gru_iqm"], agg["paper_best_iqm"]], marker="x", color="k")
        agg_ax.set_xticks([0, 1, 2], ["ours", "GRU", "best"])
        agg_ax.set_ylim(-1, 1)
        agg_ax.set_title("IQM, 95 % CI")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "runs", nargs="*", type=Path, help="run directories (config.yaml, metrics.jsonl, checkpoint.pt)"
    )
    parser.add_argument(
        "--with",
        dest="earlier",
        type=Path,
        action="append",
        default=[],
        help="a table this tool wrote with --json: its rows join for the envs none of the runs is of "
        "(rows whose run directories are elsewhere or gone); repeatable",
    )
    parser.add_argument("--greedy-episodes", type=int, default=0, help="evaluate each run greedily over N episodes")
    parser.add_argument(
        "--report-every",
        type=int,
        default=REPORT_EVERY,
        help="read the mean of the last 100 episodes once per this many env steps, as RLlib reports it "
        "once per training batch (default: the paper's 65,536; 0 = every update)",
    )
    parser.add_argument("--trust-config", action="store_true", help="passed to scripts/evaluate.py")
    parser.add_argument("--json", default=None, help="write the rows and the aggregate to this file")
    parser.add_argument("--plot", default=None, help="draw the table to this image (needs matplotlib)")
    parser.add_argument(
        "--profile", default=None, help="draw rliable's performance profile of the runs' MMER to this image"
    )
    parser.add_argument("--reps", type=int, default=50_000, help="bootstrap samples of the interval (default 50,000)")
    args = parser.parse_args(argv)
    if not args.runs and not args.earlier:
        parser.error("give run directories, --with TABLE.json, or both")
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file() or not (run / "config.yaml").is_file():
            parser.error(f"{run} is not a run directory (it needs config.yaml and metrics.jsonl)")
    if args.greedy_episodes < 0:
        parser.error(f"--greedy-episodes must be >= 0, got {args.greedy_episodes}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if args.report_every < 0:
        parser.error(f"--report-every must be >= 0 env steps (0 = every update), got {args.report_every}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib (or leave --plot out)")
    if args.profile and _rliable() is None:
        parser.error(f"--profile needs rliable: {RLIABLE_EXTRA} (or leave --profile out)")
    from rl_replay.errors import SetupError, one_line

    try:
        check_one_recipe_per_env(args.runs)  # before anything is evaluated
        earlier = [e for path in args.earlier for e in read_earlier(path, args.report_every)]
        seen = [e["env"] for e in earlier]
        if len(set(seen)) != len(seen):
            twice = sorted({env for env in seen if seen.count(env) > 1})
            parser.error(f"--with files hold rows of {', '.join(twice)} more than once: pass one table per env")
        result = table(args.runs, args.greedy_episodes, args.trust_config, args.report_every, earlier, args.reps)
    except (SetupError, FileNotFoundError) as exc:  # a run refused at its door: one line
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    # What a run directory holds (env ids, paths) is shown, never obeyed: control characters escaped.
    print("\n".join(one_line(line) for line in markdown(result).splitlines()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.profile:
        try:
            performance_profile(result, args.profile)
        except ValueError as exc:  # unequal runs per env
            print(f"error: --profile: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
