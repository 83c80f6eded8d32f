"""`python -m qwen4exp`: the `qwen4exp` command."""

import sys

from .entrypoints.cli import main

sys.exit(main())
