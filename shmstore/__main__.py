"""`python -m shmstore ...` runs the command line."""

import sys

from .cli._commands import main

sys.exit(main())
