"""``python -m zerofn COMMAND ...``: the ``zerofn`` command line (zerofn/cli.py)."""
import sys

from .cli import main

sys.exit(main())
