"""Face of zerofn/io/consolidate.py (``python -m zerofn.consolidate`` runs it); re-exports it."""
import sys

from .io.consolidate import DTYPES, PREFIX, main, to_dcp, to_full

__all__ = ["DTYPES", "PREFIX", "main", "to_dcp", "to_full"]

if __name__ == "__main__":
    sys.exit(main())
