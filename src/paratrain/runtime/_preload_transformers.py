"""Imported by the forkserver where the run's model file imports transformers (prefork.LIBRARIES): transformers'
modeling base, which every GPT-2 or Llama of transformers' imports, so that each worker forked after finds it
loaded (it spent ~1.6 CPU-s on it).

Any failure is passed over: the forkserver's own loop passes over an ImportError only, and any other error (a
transformers built for another torch or torchvision raises RuntimeError) would end the forkserver, and every
launch after with an EOFError. The worker that imports the user's file then fails in transformers' own words."""

import contextlib

with contextlib.suppress(Exception):
    import transformers.modeling_utils  # noqa: F401
