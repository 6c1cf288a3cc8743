"""What a search leaves behind: a leaderboard, best.yaml, trials.csv, and two plots."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

import yaml

from .. import config as C
from ..core.optional import how_to_install, installed
from .objective import ACCURACY, Objective, of_study

RUN_ONLY = ("out", "resume", "quiet", "tensorboard", "logger")  # not part of a configuration to reuse


def rows(study: Any) -> list[dict[str, Any]]:
    """Every trial that was a real point of the search, in order."""
    out = []
    for t in study.get_trials(deepcopy=False):
        reused = t.user_attrs.get("reused")  # a proposal equal to a finished trial: its value, no training
        if t.user_attrs.get("unused") or (t.user_attrs.get("duplicate_of") is not None and reused is None):
            continue  # held no training
        params = t.user_attrs.get("params", t.params)  # as trained: floats at the space's precision
        curve = t.intermediate_values  # a pruned trial's value: its last reported value (never the best)
        value = t.value if t.value is not None or not curve else curve[max(curve)]
        out.append({"number": t.number, "state": t.state.name, "value": value, "params": dict(params),
                    "generation": t.system_attrs.get("NSGAIISampler:generation"),
                    "test_accuracy": t.user_attrs.get("test_accuracy"),
                    "test_value": t.user_attrs.get("test_value", t.user_attrs.get("test_accuracy")),
                    "train_time_s": t.user_attrs.get("train_time_s"),
                    "error": t.user_attrs.get("error") or (f"its process died ({t.user_attrs['process_died']}); "
                                                           "queued again" if "process_died" in t.user_attrs else None),
                    "worker": t.user_attrs.get("worker"), "reused": reused})
    return out


def leaderboard(trials: list[dict[str, Any]], top: int = 10, objective: Objective = ACCURACY) -> str:
    done = sorted((r for r in trials if r["state"] == "COMPLETE" and r["reused"] is None),
                  key=lambda r: objective.order(r["value"]))[:top]
    lines = [f"| rank | trial | val {objective.name} | train time (s) | parameters |", "|---|---|---|---|---|"]
    for i, r in enumerate(done, 1):
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"| {i} | {r['number']} | {r['value']:.4f} | {r['train_time_s']:.2f} | {params} |")
    return "\n".join(lines)


def write(study: Any, base: dict[str, Any], out: Path, wall_s: float | None,
          devices: dict[str, Any] | None = None, time_budget_s: float | None = None) -> dict[str, Any]:
    trials, objective = rows(study), of_study(study)
    done = [r for r in trials if r["state"] == "COMPLETE" and r["reused"] is None]  # trainings
    if not done:
        return {"trials": len(trials), "best": None}
    best = objective.best(done, lambda r: r["value"])
    config = {k: v for k, v in {**base, **best["params"]}.items() if k not in RUN_ONLY}
    for name in C.unread(C.from_dict(config), config):  # a momentum drawn for a trial that ran Adam, say
        del config[name]
    per_trial = (devices or {}).get("devices_per_trial", 1)
    if per_trial > 1:  # a pipeline or a data-parallel trial: `train --config best.yaml` runs it on as many
        config["devices"] = per_trial
    (out / "best.yaml").write_text(f"# paratrain search: trial {best['number']}, {objective.words} "
                                   f"{best['value']:.4f}; use with `paratrain train --config best.yaml`\n"
                                   + yaml.safe_dump(config, sort_keys=False))
    names = sorted({k for r in trials for k in r["params"]})
    with open(out / "trials.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", objective.key, "generation", "train_time_s", *names, "error", "worker",
                    "reused"])
        for r in trials:
            w.writerow([r["number"], r["state"], r["value"], r["generation"], r["train_time_s"],
                        *(r["params"].get(n) for n in names), r["error"], r["worker"],
                        "" if r["reused"] is None else f"trial {r['reused']}"])
    board = leaderboard(trials, objective=objective)
    (out / "leaderboard.md").write_text(board + "\n")
    if installed("matplotlib"):  # without the plots extra: the tables alone (the last line lists the files)
        _plot_fitness(trials, out / "fitness.png", objective)
    else:
        (out / "fitness.png").unlink(missing_ok=True)  # an earlier start's would mislead
    importances, why_none = _plot_importance(study, len(done), len(names), out / "importance.png")
    summary = {"trials": len(trials), "complete": len(done), "failed": sum(r["state"] == "FAIL" for r in trials),
               "reused": sum(r["reused"] is not None for r in trials),
               "pruned": sum(r["state"] == "PRUNED" for r in trials),
               "objective": objective.key, "direction": objective.direction, "best_trial": best["number"],
               "best_value": best["value"], "best_params": best["params"],
               **({"best_val_accuracy": best["value"]} if objective == ACCURACY else {}),
               "best_test_accuracy": best["test_accuracy"], "best_test_value": best["test_value"],
               "wall_time_s": wall_s,
               "time_budget_s": time_budget_s, "importance": importances, "no_importance": why_none,
               # proposals that repeated a trained point and were drawn again instead of trained
               "redrawn": sum(t.user_attrs.get("duplicate_of") is not None and t.user_attrs.get("reused") is None
                              for t in study.get_trials(deepcopy=False)),
               "devices": {k: v for k, v in (devices or {}).items() if k != "described"} or None}
    (out / "summary.yaml").write_text(yaml.safe_dump(summary, sort_keys=False))
    return {**summary, "leaderboard": board}


def _plot_fitness(trials: list[dict[str, Any]], path: Path, objective: Objective) -> None:
    """Best and median fitness per generation (genetic) or per trial (running best)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in trials if r["state"] == "COMPLETE"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if any(r["generation"] is not None for r in done):
        gens = sorted({r["generation"] for r in done if r["generation"] is not None})
        values = [[r["value"] for r in done if r["generation"] == g] for g in gens]
        ax.plot(gens, [objective.best(v) for v in values], marker="o", label="best")
        ax.plot(gens, [statistics.median(v) for v in values], marker="s", label="median")
        ax.set(xlabel="generation", title="Fitness per generation")
    else:
        xs = [r["number"] for r in done]
        running, best = [], None
        for r in done:
            best = r["value"] if best is None else objective.best([best, r["value"]])
            running.append(best)
        ax.scatter(xs, [r["value"] for r in done], s=12, label="trial")
        ax.plot(xs, running, color="C1", label="best so far")
        ax.set(xlabel="trial", title="Fitness per trial")
    ax.set_ylabel(objective.words)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


IMPORTANCE_TRIALS = 10  # trainings fANOVA needs at the least, and PER_PARAMETER for each searched parameter:
IMPORTANCE_PER_PARAMETER = 5  # fewer fit a forest to noise (a 4-trial search showed 0.5 / 0.5)


def importance_needs(parameters: int) -> int:
    """The finished trainings below which a parameter-importance plot would say nothing."""
    return max(IMPORTANCE_TRIALS, IMPORTANCE_PER_PARAMETER * parameters)


def _plot_importance(study: Any, trained: int, parameters: int,
                     path: Path) -> tuple[dict[str, float] | None, str | None]:
    """Optuna's parameter importance (fANOVA) and its plot, where `trained` finished trainings are enough;
    else None and why not (a plot of an earlier start of the search is removed: it would mislead)."""
    if trained < importance_needs(parameters):
        path.unlink(missing_ok=True)
        return None, (f"no parameter importance: {trained} trainings finished, and {parameters} parameters need "
                      f"{importance_needs(parameters)} (fewer show noise)")
    if not installed("sklearn"):  # optuna's fANOVA fits scikit-learn's random forest
        path.unlink(missing_ok=True)
        return None, ("no parameter importance: Optuna's fANOVA needs scikit-learn, which is not installed "
                      f"({how_to_install('sklearn')})")
    importances = _importances(study)
    if not importances:
        path.unlink(missing_ok=True)
        return None, "no parameter importance: no searched parameter varied among the finished trials"
    if not installed("matplotlib"):
        path.unlink(missing_ok=True)
        return {k: float(v) for k, v in importances.items()}, f"no importance.png: matplotlib is not installed " \
            f"({how_to_install('matplotlib')}); summary.yaml has the figures"
    _plot_bars(importances, path)
    return {k: float(v) for k, v in importances.items()}, None


def _importances(study: Any) -> dict[str, float] | None:
    import warnings

    import optuna

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError):  # a parameter that never varied, say
        return None


def _plot_bars(importances: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    ax.barh(names, [importances[n] for n in names])
    ax.set(xlabel="importance (fANOVA)", title="Parameter importance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
