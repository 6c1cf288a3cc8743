"""`python -m paratrain ...`, which is how torchrun starts it: `torchrun ... -m paratrain train`."""

import sys

from .cli import main

sys.exit(main())
