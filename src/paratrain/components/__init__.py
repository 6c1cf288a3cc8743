"""What a training run is made of, whatever its parallelism: the network, optimizer and loss from the
configuration or the user's own (`build`, `parts`, `parts_check`), its data from what the caller gave
(`inputs`), optimizers and schedules (`optim`), losses (`losses`), metrics (`metrics`), evaluation
(`evaluation`), BatchNorm over the global batch (`batchnorm`), the phases of a step timed (`phases`), and
the run's log (`log`: metrics.jsonl, TensorBoard, summary.json)."""
