"""Face of zerofn/io/consolidate.py (``python -m zerofn.consolidate`` runs it); re-exports it."""
import sys

from .io.consolidate import DTYPES, PREFIX, main, single_process, to_dcp, to_full

_single_process = single_process  # (alias for zerofn/deepspeed until it imports the public name)

__all__ = ["DTYPES", "PREFIX", "main", "to_dcp", "to_full"]

if __name__ == "__main__":
    sys.exit(main())
