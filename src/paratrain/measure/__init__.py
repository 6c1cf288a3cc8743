"""What the parallelism buys, measured: `bench` (the same training in several configurations), `scaling` (the model
behind `paratrain plan`), `autodevices` (`--devices auto` on CPUs), `plot`, and `doctor/` (the machine checked)."""
