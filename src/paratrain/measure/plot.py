"""Pictures and a Markdown report of a bench (or of finished runs). matplotlib is imported only here."""

from __future__ import annotations

from pathlib import Path

from ..core.optional import how_to_install, installed
from ..optimization.phases import PHASES


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:  # noqa: ANN001
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if r["status"] == "ok"]


def epoch_times(results: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in _ok(results):
        times = r["epoch_times_s"]
        ax.plot(range(1, len(times) + 1), times, marker="o", label=r["name"])
    ax.set(xlabel="epoch", ylabel="epoch time (s)", title="Epoch time per epoch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def mean_times(results: list[dict], path: Path) -> None:
    plt = _plt()
    rows = _ok(results)
    kinds = [("epoch_time_s", "mean epoch"), ("eval_time_s", "evaluation (all)"), ("total_time_s", "total run")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows) + 2), 4.5))
    width = 0.8 / len(kinds)
    for j, (key, label) in enumerate(kinds):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        means = [r[key]["mean"] or 0 for r in rows]
        errs = [r[key]["std"] or 0 for r in rows]
        bars = ax.bar(xs, means, width, yerr=errs, capsize=3, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20)
    ax.set(ylabel="seconds", title="Mean epoch, evaluation and total time")
    ax.legend(fontsize=8)
    _save(fig, path)


def scaling(results: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list[dict]] = {}
    for r in _ok(results):
        if r["family"] != "cpu":  # the thread rows are not a device count
            families.setdefault(r["family"], []).append(r)
    for family, rows in families.items():
        rows.sort(key=lambda r: r["devices"])
        ns = [r["devices"] for r in rows]
        line = ax.errorbar(ns, [r["examples_per_sec"]["mean"] for r in rows],
                           yerr=[r["examples_per_sec"]["std"] for r in rows], marker="o", capsize=3, label=family)
        base = next((r for r in rows if r["devices"] == 1), None)
        if base is not None and len(ns) > 1:  # in its curve's colour: several curves, several ideals
            ideal = [base["examples_per_sec"]["mean"] * n for n in ns]
            ax.plot(ns, ideal, linestyle="--", color=line[0].get_color(), alpha=0.6, label=f"{family} ideal (linear)")
    counts = sorted({r["devices"] for rows in families.values() for r in rows})
    if counts:
        ax.set_xticks(counts)
    ax.set(xlabel="devices", ylabel="examples / second", title="Throughput against device count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def breakdown(results: list[dict], path: Path) -> None:
    plt = _plt()
    rows = [r for r in _ok(results) if r.get("step_phases_s")]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 4.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        ms = [1000 * (r["step_phases_s"][phase] or 0.0) for r in rows]  # None: inside the backward
        ax.bar(range(len(rows)), ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20)
    ax.set(ylabel="ms per step", title="Where a step's time goes (timed runs, no overlap)")
    ax.legend(fontsize=8)
    _save(fig, path)


def _fmt(stat: dict | None, digits: int = 2) -> str:
    if not stat or stat["mean"] is None:
        return "-"
    if stat.get("n", 2) < 2:  # one value has no spread to show
        return f"{stat['mean']:,.{digits}f}"
    return f"{stat['mean']:,.{digits}f} ± {stat['std']:,.{digits}f}"


def _plots(results: list[dict]) -> dict:
    """The plots the results can fill: scaling needs two device counts of one kind, the breakdown timed runs."""
    plots = {"epoch_times.png": epoch_times, "times.png": mean_times}
    counts: dict[str, set] = {}
    for r in _ok(results):
        if r["family"] != "cpu":
            counts.setdefault(r["family"], set()).add(r["devices"])
    if any(len(c) > 1 for c in counts.values()):
        plots["scaling.png"] = scaling
    if any(r.get("step_phases_s") for r in _ok(results)):
        plots["breakdown.png"] = breakdown
    return plots


def write_report(report: dict, out: Path, title: str = "paratrain bench", rates: str = "windows") -> Path:
    """results.json's content -> PNG plots and report.md in `out`. `rates`: where examples/s come from, the
    logged windows after the first (a bench) or each run's summary (`paratrain report` on runs)."""
    results = report["results"]
    plots = _plots(results) if installed("matplotlib") else {}  # without the plots extra: the tables alone
    for name, draw in plots.items():
        draw(results, out / name)
    ctx = report["context"]
    flags = report.get("train_flags")
    # a task without classes (a regression) reports no accuracy: its test loss takes the column
    judged = "test_accuracy" if any((r.get("test_accuracy") or {}).get("n") for r in results) or \
        not any((r.get("test_loss") or {}).get("n") for r in results) else "test_loss"
    lines = [f"# {title}", "",
             f"torch {ctx['torch_version']}, CPU {ctx['cpu']['model']} ({ctx['cpu']['cores']} cores), "
             f"GPUs: {', '.join(g['name'] for g in ctx['gpus']) or 'none'}; {ctx['time']}.",
             *([f"Training flags: `{' '.join(flags)}`; repeats: {report.get('repeats', 1)}."] if flags else []), "",
             "| configuration | devices | examples/s | speed-up | efficiency | epoch (s) | evaluation (s) | total (s) "
             f"| {judged.replace('_', ' ')} | step ms: data / compute / all-reduce / optimizer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['devices']} | failed: {r['error']} | | | | | | | |")
            continue
        phases, pipe = r.get("step_phases_s"), r.get("pipeline")
        split = " / ".join("-" if phases[p] is None else f"{1000 * phases[p]:.1f}" for p in PHASES) \
            if phases else "-"
        if pipe and pipe["bubble"]["measured_mean"] is not None:  # a pipeline's step: the stages' idle time instead
            split = (f"bubble {pipe['bubble']['measured_mean']:.0%} measured, "
                     f"{pipe['bubble']['theoretical']:.0%} in theory")
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        eff = f"{100 * r['efficiency']:.0f}%" if r.get("efficiency") is not None else "-"
        name = f"{r['name']} (= {r['same_as']})" if r.get("same_as") else r["name"]
        name += " (oversubscribed)" if r.get("oversubscribed") else ""
        rate = _fmt(r["examples_per_sec"], 0) + (f" ({_fmt(r['tokens_per_sec'], 0)} tokens/s)"
                                                 if r.get("tokens_per_sec") else "")
        lines.append(f"| {name} | {r['devices']} | {rate} | {speed} | {eff} | "
                     f"{_fmt(r['epoch_time_s'])} | {_fmt(r['eval_time_s'])} | {_fmt(r['total_time_s'])} | "
                     f"{_fmt(r.get(judged), 4)} | {split} |")
    rate_note = ("Examples/s exclude each run's first logged window (warm-up)" if rates == "windows" else
                 "Examples/s are each run's own figure (its summary: every training step over the training time)")
    notes = [f"{rate_note}; epoch times exclude the first epoch."]
    if any(r.get("speedup") is not None for r in results):
        against = ("the 1-device row of the same kind of device" if rates == "windows" else
                   "the first 1-device run of the same workload (model, dataset and global batch)")
        notes.append(f"Speed-up is against {against}; efficiency is speed-up / devices.")
    if any(r.get("same_as") for r in results):
        notes.append("A row marked (= X) runs exactly as X does (same processes and threads): it is measured once.")
    if "breakdown.png" in plots:
        notes.append("The step breakdown comes from a run with --time-phases" + (
            " (a separate 30-step run, step 1 left out)" if rates == "windows" else "") + ", which synchronises "
            "around each phase and all-reduces after the backward pass instead of during it.")
    if any(r.get("resumed_from_step") for r in results):
        notes.append("A resumed run's times cover the part after its resume only.")
    if not installed("matplotlib"):
        notes.append(f"No plots: matplotlib is not installed ({how_to_install('matplotlib')}).")
    lines += ["", " ".join(notes), ""]
    lines += [f"![{name[:-4]}]({name})" for name in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_curve(rows: list, path: Path, link: str) -> None:
    """Throughput and scaling efficiency against the device count, the axis labelled with the counts (1, 2,
    4, ... 1024), not as powers of ten."""
    from matplotlib.ticker import FixedLocator, NullLocator

    plt = _plt()
    fig, (ax, eff) = plt.subplots(1, 2, figsize=(11, 4.5))
    ns = [row[0]["devices"] for row in rows]
    ax.plot(ns, [row[0]["examples_per_sec"] for row in rows], marker="o", label="no overlap")
    ax.plot(ns, [row[1]["examples_per_sec"] for row in rows], marker="s", label="all-reduce overlapped")
    ax.plot(ns, [row[2]["examples_per_sec"] for row in rows], marker="^", label="fsdp, overlapped")
    ax.plot(ns, [rows[0][0]["examples_per_sec"] * n for n in ns], "--", color="gray", label="ideal (linear)")
    ax.set(yscale="log", ylabel="examples / second", title=f"Predicted data-parallel throughput ({link})")
    eff.plot(ns, [100 * row[0]["efficiency"] for row in rows], marker="o", label="no overlap")
    eff.plot(ns, [100 * row[1]["efficiency"] for row in rows], marker="s", label="all-reduce overlapped")
    eff.plot(ns, [100 * row[2]["efficiency"] for row in rows], marker="^", label="fsdp, overlapped")
    eff.set(ylabel="scaling efficiency (%)", ylim=(0, 105), title="Scaling efficiency (throughput / (N x one))")
    for a in (ax, eff):
        a.set_xscale("log", base=2)
        a.xaxis.set_major_locator(FixedLocator(ns))
        a.xaxis.set_minor_locator(NullLocator())
        a.set_xticks(ns, [str(n) for n in ns], fontsize=7)
        a.set_xlabel("devices")
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    _save(fig, path)
