"""Files and formats: checkpoints, Hugging Face weights, consolidation, atomic placement.

Dependency rule: io persists through the state-dict verbs and the runtime's public
gather; it never touches hooks or buffers. True today of ``checkpoint/`` (it reads and
writes ``zerofn.state_dict``'s state dicts; ``staging.py`` borrows the runtime's pinned
host allocator for its staging copy), ``consolidate.py`` and ``fs.py``. Not yet of
``pretrained/``: it reads and writes the parameters' master rows through the runtime's
units and slots (``state_dict._slots_by_name``, ``units.local_rows``), gathers a unit's
rows with the runtime's ``comm.all_gather`` itself, and calls ``prepare_state_dict`` /
``refresh_params`` around that.

``fs.py`` is the one place that puts a finished file or directory in place (a rename
that a crash cannot leave half done); ``zerofn/runtime/agree.py`` the one cross-rank
agreement every collective entry point here starts with.
"""
