"""`python -m paratrain.cli ...`, the same as `paratrain ...`."""

from . import entry

entry()
