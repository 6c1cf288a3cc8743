"""NSGA-II whose generations count the trainings a pruner stopped.

Optuna's NSGA-II fills a generation with `population` COMPLETE trials, and a pruned trial never counts: with
`--pruner median`, which stopped 177 of 200 MLP trainings on MNIST, generation 0 took 116 trainings and the
search reached generation 3 of 10, spending its budget on random draws. Here a pruned training is a member
of its generation with the last validation accuracy it reported (below the trainings that ran on, so the
selection weighs it for what it showed). The study keeps it PRUNED, and it never wins the search.
"""

from __future__ import annotations

import copy
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState


def as_member(trial: FrozenTrial) -> FrozenTrial | None:
    """A trial as the genetic selection sees it: a finished one as it is, a pruned training with its last
    reported value, anything else (a redrawn duplicate, an unused place: no training) not at all."""
    if trial.state == TrialState.COMPLETE:
        return trial
    if trial.state != TrialState.PRUNED or not trial.intermediate_values:
        return None
    member = copy.copy(trial)
    member.state = TrialState.COMPLETE
    member.values = [trial.intermediate_values[max(trial.intermediate_values)]]
    return member


class PrunedCountingNSGAII(optuna.samplers.NSGAIISampler):
    @classmethod
    def _get_generation_key(cls) -> str:
        return "NSGAIISampler:generation"  # Optuna's own key: trials.csv and the plots read it, as do old studies

    def _members(self, study: Any) -> list[FrozenTrial]:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return [m for m in map(as_member, trials) if m is not None]

    def get_trial_generation(self, study: Any, trial: FrozenTrial) -> int:
        """Optuna's rule (the newest generation until it holds `population` members, then the next), counting
        pruned trainings as members."""
        key = self._get_generation_key()
        generation = trial.system_attrs.get(key)
        if generation is not None:
            return generation
        top, count = 0, 0
        for t in self._members(study):
            g = t.system_attrs.get(key, -1)
            if g > top:
                top, count = g, 1
            elif g == top:
                count += 1
        generation = top if count < self._population_size else top + 1
        study._storage.set_trial_system_attr(trial._trial_id, key, generation)
        return generation

    def get_population(self, study: Any, generation: int) -> list[FrozenTrial]:
        key = self._get_generation_key()
        return [t for t in self._members(study) if t.system_attrs.get(key) == generation]

    def get_parent_population(self, study: Any, generation: int) -> list[FrozenTrial]:
        """The parents Optuna cached by trial id, a pruned one with its last value (the selection compares
        values)."""
        parents = [as_member(t) for t in super().get_parent_population(study, generation)]
        return [p for p in parents if p is not None]
