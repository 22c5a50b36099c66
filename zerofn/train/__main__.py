"""``python -m zerofn.train`` and ``torchrun -m zerofn.train``: the main job."""
from . import main

main()
