"""How a model is trained and judged: optimizers and learning-rate schedules (`optim`), losses (`losses`),
metrics beside the loss (`metrics`), evaluation over the workers (`evaluation`) and the phases of a step timed
(`phases`)."""
