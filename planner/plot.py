"""PNG charts of a simulation: strategies compared, and per-rank timelines of one step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hdp import StepReport, format_size, plural

from .sim import SimResult


def _timeline(ax, report: StepReport, title: str) -> None:
    """One horizontal segment per (rank, wave) cell, from its start for its busy time."""
    from matplotlib.collections import LineCollection

    W, N = report.busy_s.shape
    ww, rr = np.nonzero(report.busy_s > 0)
    x0 = report.start_s[ww, rr]
    x1 = x0 + report.busy_s[ww, rr]
    segs = np.stack([np.stack([x0, rr], 1), np.stack([x1, rr], 1)], 1)
    colours = np.where(ww % 2 == 0, "tab:blue", "tab:orange")
    width = max(0.3, min(6.0, 300.0 / max(N, 1)))
    ax.add_collection(LineCollection(segs, colors=colours, linewidths=width))
    ax.set_xlim(0, max(float(x1.max()) if x1.size else 1.0, 1e-9) * 1.02)
    ax.set_ylim(-1, N)
    ax.invert_yaxis()
    ax.set_xlabel("time in step (s)")
    ax.set_ylabel("rank")
    if W > 1:
        from matplotlib.lines import Line2D

        waves = [Line2D([], [], color=c, linewidth=4) for c in ("tab:blue", "tab:orange")]
        ax.legend(waves, ["waves 1, 3, ...", "waves 2, 4, ..."], fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)


def plot_simulation(sim: SimResult, path: str | Path) -> None:
    """Bar chart of step time against the lower bound, then the best and worst strategies'
    per-rank timelines of the first simulated step (alternating colours = successive waves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in sim.results.items() if r.error is None and r.per_step}
    if not ok:
        raise ValueError("no strategy produced a plan: nothing to plot")
    names = list(ok)
    means = [ok[n].mean() for n in names]
    steps = [m["step_time_s"] for m in means]
    bound = means[0]["lower_bound_s"]
    best = names[int(np.argmin(steps))]
    worst = names[int(np.argmax(steps))]
    fig = plt.figure(figsize=(12, 8))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.4])
    ax = fig.add_subplot(grid[0, :])
    x = np.arange(len(names))
    exposed = [m["exposed_comm_s"] for m in means]
    ax.bar(x, np.array(steps) - np.array(exposed), color="tab:blue", label="compute / waiting")
    ax.bar(
        x,
        exposed,
        bottom=np.array(steps) - np.array(exposed),
        color="tab:red",
        label="exposed communication",
    )
    ax.axhline(
        bound, color="black", linestyle="--", linewidth=1, label=f"lower bound {bound:.2f} s"
    )
    for i, (t, m) in enumerate(zip(steps, means)):
        ax.text(
            i,
            t,
            f"{t:.2f} s\n{m['step_over_bound']:.2f}x LB",  # the table's step/LB
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, names)
    ax.set_ylabel("predicted step time (s)")
    ax.set_ylim(0, max(steps) * 1.25)
    c = sim.config
    ax.set_title(
        f"{c['workload']}: {c['model']} on {c['gpus']} x {c['gpu']}, "
        f"{format_size(c['tokens_per_step'])} tokens/step, "
        f"mean of {plural(c['steps'], 'step')}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right")
    for col, name in enumerate((best, worst)):
        rep = ok[name].first_report
        _timeline(
            fig.add_subplot(grid[1, col]),
            rep,
            f"{name} ({'best' if name == best else 'worst'}): step 1, {rep.step_time_s:.2f} s, "
            f"imbalance {rep.imbalance:.2f}",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
