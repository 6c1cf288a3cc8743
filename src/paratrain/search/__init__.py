"""Hyper-parameter parallelism: many trainings at once, searched by Optuna (grid, NSGA-II, TPE, random)."""
