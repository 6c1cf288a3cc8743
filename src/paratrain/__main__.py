"""`python -m paratrain ...`, which is how torchrun starts it: `torchrun ... -m paratrain train`."""

from .cli import entry

entry()
