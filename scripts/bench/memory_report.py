"""``memory.py``'s reporting: derived numbers, target verdicts, tables, plots.

Everything here reads the result dicts of ``memory_worker.worker`` (measured,
merged from an earlier ``--json``, or both) and measures nothing.
"""

from __future__ import annotations

from scripts.bench.memory_worker import METHODS
from scripts.bench.policies import POLICIES, count_params
from scripts.bench.report import fmt_bytes, fmt_s


def result_line(r: dict) -> str:
    """One measured configuration, as printed while the benchmark runs."""
    parts = [f"live {fmt_bytes(r['live_bytes']):>10}", f"rss+ {fmt_bytes(r['rss_growth']):>10}"]
    if r.get("cuda_peak_growth") is not None:
        parts.append(f"cuda+ {fmt_bytes(r['cuda_peak_growth'])}")
    parts.append(f"fwd {fmt_s(r['fwd_s']):>9}")
    if r["mode"] == "memory_only":
        parts.append("bwd  (memory only: no backward within the time budget)")
    else:
        parts.append(f"bwd {fmt_s(r['bwd_s']):>9}")
    if "block_input_bytes" in r:
        parts.append(f"inputs {fmt_bytes(r['block_input_bytes'])}")
    if "grad_abs" in r:
        parts.append(f"grad vs {r['grad_ref_method']}: abs {r['grad_abs']:.1e} rel {r['grad_rel']:.1e}")
    if r["mode"] == "full":
        parts.append(f"(median of {r['timing_reps']}, {r['process_s']:.0f} s)")
    else:
        parts.append(f"({r['process_s']:.0f} s)")
    return "  ".join(parts)


def ok(r):
    """Measured (memory at least)."""
    return r is not None and "error" not in r and "skipped" not in r


def timed(r):
    """Measured with backward and timings."""
    return ok(r) and r.get("mode") == "full"


def find(results, policy, T, method):
    for r in results:
        if r["policy"] == policy and r["T"] == T and r["method"] == method:
            return r
    return None


TARGETS = {
    "slope": 1.25,  # rl_replay live-memory growth per step / block-input bytes per step
    "mem_ratio": 0.10,  # rl_replay / plain live memory at T = 1024
    "time_ratio": 1.4,  # rl_replay / plain total time at T = 256 (deep MLP)
    "fixed_cost": 0.2e-3,  # seconds per block, small GRU at T = 1024
}


def analyse(results: list[dict], policy: str) -> dict:
    """Derived numbers and target verdicts for one policy."""
    out: dict = {"policy": policy, "targets": []}
    Ts = sorted({r["T"] for r in results if r["policy"] == policy})
    rep = [r for r in (find(results, policy, T, "rl_replay") for T in Ts) if ok(r)]
    if len(rep) >= 2:
        a, b = rep[0], rep[-1]
        slope = (b["live_bytes"] - a["live_bytes"]) / (b["T"] - a["T"])
        inputs_per_step = b["block_input_bytes"] / b["T"]
        out.update(
            slope_bytes_per_step=slope,
            inputs_per_step=inputs_per_step,
            slope_ratio=slope / inputs_per_step,
            slope_T=(a["T"], b["T"]),
            rss_slope_ratio=(b["rss_growth"] - a["rss_growth"]) / (b["T"] - a["T"]) / inputs_per_step,
        )
    for T in Ts:
        p, r = find(results, policy, T, "plain"), find(results, policy, T, "rl_replay")
        c = find(results, policy, T, "checkpoint_cpu")
        td = find(results, policy, T, "rl_replay_td")
        if ok(p) and ok(r):
            out.setdefault("mem_ratio", {})[T] = r["live_bytes"] / p["live_bytes"]
            out.setdefault("rss_ratio", {})[T] = r["rss_growth"] / max(1, p["rss_growth"])
        if timed(p) and timed(r):
            out.setdefault("time_ratio", {})[T] = r["total_s"] / p["total_s"]
            out.setdefault("fixed_cost", {})[T] = (r["total_s"] - p["total_s"] - r["nograd_fwd_s"]) / T
        if timed(c) and timed(r):
            out.setdefault("time_vs_ckpt_cpu", {})[T] = r["total_s"] / c["total_s"]
        if timed(p) and timed(td):
            out.setdefault("fixed_cost_td", {})[T] = (td["total_s"] - p["total_s"] - td["nograd_fwd_s"]) / T
    worst = [(r["grad_abs"], r["grad_rel"]) for r in results if r["policy"] == policy and ok(r) and "grad_abs" in r]
    if worst:
        out["grad_abs"] = max(w[0] for w in worst)
        out["grad_rel"] = max(w[1] for w in worst)

    def verdict(name, value, limit, text, missing):
        if value is None:
            out["targets"].append(f"target {name} [{policy}]: NOT MEASURED ({missing})")
        else:
            met = value <= limit
            out["targets"].append(f"target {name} [{policy}]: {'MET' if met else 'MISSED'} ({text})")

    if policy in ("gru", "mlp"):
        v = out.get("slope_ratio")
        verdict(
            "memory growth <= 1.25x block inputs/step",
            v,
            TARGETS["slope"],
            v is not None
            and f"{v:.3f}x: {fmt_bytes(out['slope_bytes_per_step'])}/step vs inputs "
            f"{fmt_bytes(out['inputs_per_step'])}/step, T {out['slope_T'][0]}->{out['slope_T'][1]}",
            "rl_replay needs two T values",
        )
        v = out.get("mem_ratio", {}).get(1024)
        verdict(
            "live memory at T=1024 <= 10% of plain",
            v,
            TARGETS["mem_ratio"],
            v is not None
            and f"{100 * v:.1f}% ({fmt_bytes(find(results, policy, 1024, 'rl_replay')['live_bytes'])}"
            f" vs {fmt_bytes(find(results, policy, 1024, 'plain')['live_bytes'])}; peak RSS growth "
            f"{100 * out['rss_ratio'][1024]:.1f}%)",
            "plain or rl_replay not measured at T=1024",
        )
    if policy == "mlp":
        v = out.get("time_ratio", {}).get(256)
        verdict(
            "total time at T=256 <= 1.4x plain",
            v,
            TARGETS["time_ratio"],
            v is not None and f"{v:.3f}x",
            "plain or rl_replay not timed at T=256",
        )
        v = out.get("time_vs_ckpt_cpu", {}).get(256)
        verdict(
            "total time at T=256 no slower than checkpoint+save_on_cpu",
            v,
            1.0,
            v is not None and f"{v:.3f}x of method 3",
            "not timed at T=256",
        )
    if policy == "small_gru":
        v = out.get("fixed_cost", {}).get(1024)
        verdict(
            "fixed cost per block <= 0.2 ms",
            v,
            TARGETS["fixed_cost"],
            v is not None and f"{v * 1e3:.3f} ms/block",
            "not timed at T=1024",
        )
    return out


def summary_line(a: dict) -> str:
    parts = [f"summary {a['policy']}:"]
    if "slope_ratio" in a:
        parts.append(
            f"rl_replay live memory grows {fmt_bytes(a['slope_bytes_per_step'])}/step = "
            f"{a['slope_ratio']:.2f}x block inputs ({fmt_bytes(a['inputs_per_step'])}/step, "
            f"T {a['slope_T'][0]}->{a['slope_T'][1]});"
        )
    if a.get("mem_ratio"):
        T = 1024 if 1024 in a["mem_ratio"] else max(a["mem_ratio"])
        parts.append(
            f"live memory rl_replay/plain at T={T}: {a['mem_ratio'][T]:.3f} (peak RSS growth {a['rss_ratio'][T]:.3f});"
        )
    if a.get("time_ratio"):
        T = 256 if 256 in a["time_ratio"] else max(a["time_ratio"])
        s = f"total time rl_replay/plain at T={T}: {a['time_ratio'][T]:.3f}x"
        if T in a.get("time_vs_ckpt_cpu", {}):
            s += f", vs checkpoint+save_on_cpu {a['time_vs_ckpt_cpu'][T]:.3f}x"
        parts.append(s + ";")
    if a.get("fixed_cost"):
        T = 1024 if 1024 in a["fixed_cost"] else max(a["fixed_cost"])
        s = f"replay fixed cost {a['fixed_cost'][T] * 1e3:.3f} ms/block at T={T}"
        if T in a.get("fixed_cost_td", {}):
            s += f" (TensorDict path {a['fixed_cost_td'][T] * 1e3:.3f} ms)"
        parts.append(s + ";")
    if "grad_abs" in a:
        parts.append(f"grad worst abs {a['grad_abs']:.1e} rel {a['grad_rel']:.1e}")
    return " ".join(parts)


def markdown_table(results: list[dict], policy: str) -> str:
    cfg = POLICIES[policy]
    head = (
        f"**{policy}** ({count_params(cfg) / 1e6:.2f} M parameters; "
        + ", ".join(f"{k}={v}" for k, v in cfg.items())
        + ")\n\n"
        "| T | method | live bytes for backward | peak RSS growth | rollout fwd | backward "
        "| total | vs plain | grad max abs / rel diff | timed runs (median) |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    order = list(METHODS) + ["rl_replay_td"]
    for r in sorted((r for r in results if r["policy"] == policy), key=lambda r: (r["T"], order.index(r["method"]))):
        if not ok(r):
            why = r.get("skipped") or r.get("error")
            rows.append(f"| {r['T']} | {r['method']} | {why} | | | | | | | |")
            continue
        p = find(results, policy, r["T"], "plain")
        if r["mode"] == "memory_only":
            rows.append(
                f"| {r['T']} | {r['method']} | {fmt_bytes(r['live_bytes'])} | "
                f"{fmt_bytes(r['rss_growth'])} (fwd only) | {fmt_s(r['fwd_s'])} | "
                f"memory only: no backward in the time budget | | | | 1 (forward) |"
            )
            continue
        vs = f"{r['total_s'] / p['total_s']:.2f}x" if timed(p) else "-"
        g = f"{r['grad_abs']:.1e} / {r['grad_rel']:.1e}" if "grad_abs" in r else "(reference)"
        reps = r["timing_reps"]
        rows.append(
            f"| {r['T']} | {r['method']} | {fmt_bytes(r['live_bytes'])} | "
            f"{fmt_bytes(r['rss_growth'])} | {fmt_s(r['fwd_s'])} | {fmt_s(r['bwd_s'])} | "
            f"{fmt_s(r['total_s'])} | {vs} | {g} | {reps} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(results: list[dict], policy: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "plain": ("C0", "o"),
        "checkpoint": ("C1", "s"),
        "checkpoint_cpu": ("C2", "^"),
        "rl_replay": ("C3", "D"),
        "rl_replay_td": ("C4", "v"),
    }
    for method, (color, marker) in styles.items():
        rs = sorted(
            (r for r in results if r["policy"] == policy and r["method"] == method and ok(r)), key=lambda r: r["T"]
        )
        if not rs:
            continue
        Ts = [r["T"] for r in rs]
        ax_m.plot(
            Ts,
            [r["live_bytes"] / 2**20 for r in rs],
            "-",
            marker=marker,
            color=color,
            label=f"{method} live",
            alpha=0.85,
        )
        ax_m.plot(
            Ts,
            [max(r["rss_growth"], 1) / 2**20 for r in rs],
            ":",
            marker=marker,
            color=color,
            alpha=0.45,
            mfc="none",
            label=f"{method} peak RSS growth",
        )
        tt = [r for r in rs if timed(r)]
        if tt:
            ax_t.plot(
                [r["T"] for r in tt],
                [r["total_s"] for r in tt],
                "-",
                marker=marker,
                color=color,
                label=method,
                alpha=0.85,
            )
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rollout length T (policy calls)")
        ax.grid(True, which="both", alpha=0.3)
    ax_m.set_ylabel("MiB")
    ax_m.set_title(f"{policy}: memory held for backward (end of rollout forward)", fontsize=10)
    ax_t.set_ylabel("seconds (rollout forward + backward)")
    ax_t.set_title(f"{policy}: time (rollout forward + backward, median)", fontsize=10)
    ax_m.legend(fontsize=6.5, ncol=2)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def docs_section(results: list[dict], analyses: list[dict], policies: list[str]) -> str:
    """The marked docs section: one table per policy, the summary lines and the verdicts."""
    body = "\n".join(markdown_table(results, p) for p in policies)
    body += "\n" + "\n".join("    " + summary_line(a) for a in analyses)
    body += "\n" + "\n".join("    " + t for a in analyses for t in a["targets"]) + "\n"
    return body
