"""Checkpoint <-> full state dict file; the same as ``python -m zerofn.consolidate``."""
import sys

from zerofn.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
