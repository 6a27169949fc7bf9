"""Memory and time of one rollout's gradient: plain autograd vs checkpointing vs rl_replay.

For each policy and rollout length T this runs a T-step rollout (the policy called once
per timestep, an A2C-style loss, one ``backward``) four ways, each configuration in a
fresh process. The loss (``--loss``) is built from one small graph per step by default;
``--loss stacked`` computes the same terms once on the stacked ``(T, B)`` outputs, as the
trainer's losses do (O(1) graph nodes instead of ~10 per step):

1. ``plain``           plain autograd, the whole graph kept until backward;
2. ``checkpoint``      ``torch.utils.checkpoint.checkpoint(policy, ..., use_reentrant=False)``
                       per timestep;
3. ``checkpoint_cpu``  the same inside ``torch.autograd.graph.save_on_cpu`` (on a CPU
                       machine ``save_on_cpu`` keeps tensors where they are);
4. ``rl_replay``       ``rl_replay.checkpoint_fsdp_forward`` per timestep (small_gru also
                       runs ``rl_replay_td``: ``rl_replay.replay`` with a TensorDict, the
                       trainer's code path).

Measured per configuration: live tensor bytes held for backward at the end of the rollout
forward (see ``LiveTensorCensus`` in ``common.py``), peak RSS growth (CPU) or
``torch.cuda.max_memory_allocated`` growth (CUDA), rollout-forward time, backward time,
and the gradients of methods 2-4 against method 1.

Time and memory budgets: a worker times a short warm-up rollout and, against
``--max-config-seconds`` (and what is left of ``--budget-seconds``), runs the full
configuration with fewer timing repetitions, or only the forward (memory, no backward),
or skips it, saying why; a configuration whose memory estimate (from the same method at
a smaller T) exceeds ``--mem-budget-gib`` is skipped before it starts. Within each T the
methods run in the order plain, rl_replay, checkpoint_cpu, checkpoint, so a budget cut
drops the baselines first. ``--json`` keeps every result; ``--merge`` adds a later run to
them and ``--render-only`` redraws tables, plots and the docs section from them.

``--rss`` runs the other memory measure instead, with its own options: peak RSS growth per rollout
step against the bytes a block saves per step, over two T and four allocator settings
(``scripts/bench/rss.py``; ``python -m scripts.bench memory --rss --help``).

A run prints its tables and writes no committed file: ``--write-docs [PATH]`` updates the
marked section of PATH (default docs/benchmarks.md) and draws the plots next to it (or
into ``--plot-dir``). Measuring one configuration is ``memory_worker.py``, the
policies ``policies.py``, tables, plots and verdicts ``memory_report.py``.

Usage::

    python -m scripts.bench memory --smoke
    python -m scripts.bench memory --policy gru --write-docs
    python -m scripts.bench memory --policy mlp --T 1024 --methods plain rl_replay --merge --json r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from scripts.bench.common import GLIBC_NOTE, describe_machine, load_line, run_isolated, worker_cli
from scripts.bench.memory_report import (
    analyse,
    docs_section,
    markdown_table,
    ok,
    plot,
    result_line,
    summary_line,
)
from scripts.bench.memory_worker import METHODS, worker
from scripts.bench.policies import POLICIES, count_params
from scripts.bench.report import add_write_docs_argument, refuse_smoke_docs, write_section

PRELOAD = [
    "torch",
    "torch.utils.checkpoint",
    "tensordict",
    "rl_replay",
    "scripts.bench.common",
    "scripts.bench.policies",
    "scripts.bench.memory_worker",
]
DEFAULT_TS = (64, 256, 1024, 4096)


# ============================================================================ orchestration
RUN_ORDER = ("plain", "rl_replay", "checkpoint_cpu", "checkpoint", "rl_replay_td")


def methods_for(policy: str, requested: list[str] | None) -> list[str]:
    """Methods in run order: plain first (the gradient reference), then rl_replay, so a
    run that hits its time budget loses the checkpoint baselines first."""
    methods = requested or (list(METHODS) + (["rl_replay_td"] if policy in ("small_gru", "tiny_gru") else []))
    return sorted(methods, key=RUN_ORDER.index)


def estimate_plain_bytes(prev: dict | None, T: int) -> float | None:
    """Peak estimate for T from the same method at a smaller T: the live bytes scale with
    T; the rest of the measured RSS growth (gradients, one block's transients, heap kept
    by glibc) is taken as fixed."""
    if not prev or "live_bytes" not in prev:
        return None
    fixed = max(0, prev.get("rss_growth", 0) - prev["live_bytes"])
    return prev["live_bytes"] / prev["T"] * T + fixed + prev["param_bytes"]


def run_policy(policy: str, args, tmpdir: str, log, deadline: float) -> list[dict]:
    cfg = POLICIES[policy]
    Ts = args.T or ([8] if args.smoke else list(DEFAULT_TS))
    methods = methods_for(policy, args.methods)
    results: list[dict] = []
    prev: dict[str, dict] = {}
    too_slow: set[str] = set()  # skipped at some T: skipped at every larger T
    log(f"\n== policy {policy}: {cfg} ({count_params(cfg) / 1e6:.2f} M parameters)")
    for T in Ts:
        ref_file, ref_method = None, None
        for method in methods:
            tag = f"{policy:<9} T={T:<5} {method:<14}"
            skipped = None
            est_b = estimate_plain_bytes(prev.get(method), T)
            remaining = deadline - time.perf_counter()
            if est_b is not None and est_b > args.mem_budget_gib * 2**30:
                skipped = f"skipped: would need {est_b / 2**30:.1f} GiB (budget {args.mem_budget_gib:g} GiB)"
            elif method in too_slow:
                skipped = "skipped: over the time budget at a smaller T already"
            elif remaining < 10:
                skipped = "skipped: --budget-seconds for the whole run used up"
            if skipped:
                log(f"{tag} {skipped}")
                results.append(dict(policy=policy, T=T, method=method, skipped=skipped))
                continue
            budget = min(args.max_config_seconds, remaining)
            spec = dict(
                policy=policy,
                cfg=cfg,
                T=T,
                method=method,
                reps=args.reps,
                threads=args.threads,
                device=args.device,
                seed=0,
                budget_s=budget,
                memory_only_ok=not args.smoke,
                loss=args.loss,
            )
            if ref_file is None:
                spec["grad_out"] = os.path.join(tmpdir, f"{policy}_{T}_{method}.pt")
            else:
                spec["grad_ref"], spec["grad_ref_method"] = ref_file, ref_method
            r = run_isolated(
                worker,
                spec,
                script=__spec__.name,
                launcher=args.launcher,
                timeout=max(180.0, 4 * budget),
                preload=PRELOAD,
            )
            r.setdefault("policy", policy)
            r.setdefault("T", T)
            r.setdefault("method", method)
            results.append(r)
            if "error" in r:
                log(f"{tag} ERROR {r['error']}")
                if args.verbose and r.get("traceback"):
                    log(r["traceback"])
                continue
            if "skipped" in r:
                too_slow.add(method)
                log(f"{tag} {r['skipped']}")
                continue
            if r["mode"] == "memory_only":
                too_slow.add(method)  # larger T: not even a forward fits
            if ref_file is None and r["mode"] == "full":
                ref_file, ref_method = spec["grad_out"], method
            prev[method] = r
            log(f"{tag} {result_line(r)}")
    return results


def merge_results(earlier: list[dict], fresh: list[dict]) -> list[dict]:
    """``earlier`` results with this run's: a measured configuration replaces the same
    (policy, T, method) there; a skipped or failed one replaces only a missing or failed one."""
    key = lambda r: (r["policy"], r["T"], r["method"])  # noqa: E731
    measured = {key(r): r for r in fresh if ok(r)}
    merged = {key(r): r for r in earlier}
    for r in fresh:
        if key(r) in measured or key(r) not in merged or not ok(merged[key(r)]):
            merged[key(r)] = r
    return list(merged.values())


# ============================================================================ main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--rss" in argv:  # the per-step RSS probe (scripts/bench/rss.py), its own options
        from scripts.bench import rss

        return rss.main([a for a in argv if a != "--rss"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="+", default=["gru"], choices=sorted(POLICIES))
    ap.add_argument("--T", type=int, nargs="+", help=f"rollout lengths (default {DEFAULT_TS})")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS) + ["rl_replay_td"])
    ap.add_argument(
        "--reps", type=int, default=2, help="rollouts after the census rollout; times are the median of all 1 + reps"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    ap.add_argument(
        "--loss",
        choices=["per-step", "stacked"],
        default="per-step",
        help="per-step: A2C terms from one small graph per step (the tables' loss); "
        "stacked: the same terms on the stacked (T, B) outputs",
    )
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto")
    ap.add_argument(
        "--mem-budget-gib", type=float, default=6.0, help="skip a configuration whose estimated peak exceeds this"
    )
    ap.add_argument(
        "--max-config-seconds",
        type=float,
        default=150.0,
        help="per configuration: fewer timing reps, then forward-only memory, then "
        "skip, when it is estimated to take longer",
    )
    ap.add_argument(
        "--budget-seconds",
        type=float,
        default=float("inf"),
        help="wall-time budget of the whole run; later configurations get what is left",
    )
    ap.add_argument("--launcher", choices=["forkserver", "subprocess"], default="forkserver")
    add_write_docs_argument(ap, "bench_memory POLICY ...")
    ap.add_argument(
        "--plot-dir",
        help="directory for the plots (default: with --write-docs, the docs "
        "file's directory; otherwise a temporary one)",
    )
    ap.add_argument("--json", help="also write all results to this JSON file")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="with --json: start from the results already in that file; configurations "
        "measured now replace the same (policy, T, method) there, skipped ones do not",
    )
    ap.add_argument(
        "--render-only", action="store_true", help="measure nothing: tables, plots and docs from the results in --json"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny policies, T=8, a few seconds")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    refuse_smoke_docs(ap, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.policy = ["tiny_gru", "tiny_mlp"]
        args.reps = min(args.reps, 1)
    print(
        describe_machine(),
        f"| device {args.device}, {args.threads} thread(s) per worker, launcher {args.launcher}",
        flush=True,
    )
    if args.device == "cpu":
        print(
            "CUDA column: not measured (no CUDA device); the torch.cuda.max_memory_allocated "
            "path runs with --device cuda."
        )
    print(GLIBC_NOTE, flush=True)

    def log(msg):
        print(msg, flush=True)

    all_results: list[dict] = []
    t_start = time.perf_counter()
    deadline = t_start + args.budget_seconds
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmpdir:
        for policy in args.policy:
            if not args.render_only:
                all_results += run_policy(policy, args, tmpdir, log, deadline)
        if (args.merge or args.render_only) and args.json and os.path.exists(args.json):
            with open(args.json) as fh:
                earlier = json.load(fh)["results"]
            all_results = merge_results(earlier, all_results)
            print(f"merged with {len(earlier)} earlier results from {args.json}")
        plot_dir = args.plot_dir or (os.path.dirname(os.path.abspath(args.write_docs)) if args.write_docs else None)
        analyses = [analyse(all_results, p) for p in args.policy]
        print()
        for p in args.policy:
            print(markdown_table(all_results, p))
            try:
                path = os.path.join(plot_dir or tmpdir, f"bench_memory_{p}.png")
                plot(all_results, p, path)
                print(f"plot: {path}" + ("" if plot_dir else " (temporary: --plot-dir DIR keeps it)"))
            except Exception as exc:  # matplotlib missing or headless trouble
                print(f"plot failed: {exc}")
        for a in analyses:
            print(summary_line(a))
        for a in analyses:
            for t in a["targets"]:
                print(t)
    worst = [(r["grad_abs"], r["grad_rel"]) for r in all_results if ok(r) and "grad_abs" in r]
    if worst:
        print(
            f"gradient check: worst abs diff {max(w[0] for w in worst):.3e}, "
            f"worst rel diff {max(w[1] for w in worst):.3e} "
            f"({len(worst)} configurations of checkpoint / checkpoint_cpu / rl_replay vs plain)"
        )
    else:
        print("gradient check: nothing compared")
    errors = [r for r in all_results if "error" in r]
    print(GLIBC_NOTE)
    print(f"wall time {time.perf_counter() - t_start:.0f} s; {load_line()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"machine": describe_machine(), "args": vars(args), "results": all_results, "analysis": analyses},
                fh,
                indent=1,
                default=str,
            )
    if args.write_docs:
        write_section(
            args.write_docs, "bench_memory " + " ".join(args.policy), docs_section(all_results, analyses, args.policy)
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
