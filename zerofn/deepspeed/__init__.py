"""DeepSpeed's front door on zerofn: its config files, ``initialize`` and checkpoints."""
