"""`python -m paratrain ...`, which is how torchrun starts it: `torchrun ... -m paratrain train`."""

import sys

from .cli import main
from .launch import end_process, under_torchrun

code = main()
if under_torchrun():  # a worker of torchrun's group: leave without finalization (see end_process)
    end_process(code)
sys.exit(code)
