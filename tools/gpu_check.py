"""``python3 tools/gpu_check.py [options]``, the command the docs and the device sessions
name: it runs the package tools/gpu_check/ (``--help`` lists the options; the package's
docstring says what it checks and how its files divide)."""
from gpu_check.__main__ import main   # tools/ is sys.path[0] for a script here

if __name__ == "__main__":
    main()
