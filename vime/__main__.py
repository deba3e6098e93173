"""`python -m vime ...` is the `vime` command (for environments where the script is not on PATH)."""

import sys

from vime.cli import main

sys.exit(main())
