"""`python -m paratrain.cli ...`, the same as `paratrain ...`."""

import sys

from . import main

sys.exit(main())
