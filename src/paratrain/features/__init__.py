"""What a model is given beyond its own layers, the same under every layout: dropout drawn for the global batch
(`dropout`), BatchNorm over the global batch (`batchnorm`), activation checkpointing (`recompute`) and float8
linear layers (`float8`)."""
