"""Every record of a run that leaves the training loop, in one place: the run's own log (`log`: metrics.jsonl,
TensorBoard, summary.json), the experiment trackers (`trackers`: MLflow, W&B, CSV; `tracker_files`: the files
they read and write), and a search's and a bench's parent and child runs in them (`search`, `bench`)."""
