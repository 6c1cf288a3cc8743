"""What the parallelism buys, measured: `bench` (the same training in every configuration), `scaling` (the model
behind `paratrain plan`), `autodevices` (`--devices auto` on CPUs), `plot`, and `doctor/` (the machine checked)."""
