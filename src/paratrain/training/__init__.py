"""One worker's life: join the group, carry on from the checkpoint the group agrees on, train (`trainer.Trainer`,
its state as it goes in `state`), leave (`worker.work`)."""
