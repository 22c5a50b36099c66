"""Files and formats: checkpoints, Hugging Face weights, consolidation, atomic placement.

Dependency rule: io persists through the state-dict verbs and the runtime's public
gather; it never touches hooks or buffers. True today of ``checkpoint/`` (it reads and
writes ``zerofn.state_dict``'s state dicts, and takes only the group and the failure
watch from ``runtime_of``; ``staging.py`` borrows the runtime's pinned host allocator
for its staging copy), ``consolidate.py`` and ``fs.py``. Not yet of ``pretrained/``: it
reads and writes the parameters' master rows through the runtime's units and slots
(``state_dict._slots_by_name``, ``units.local_rows``), gathers a unit's rows with the
runtime's ``comm.all_gather`` itself, and calls ``prepare_state_dict`` /
``refresh_params`` around that.

``fs.py`` puts finished files and directories in place (renames a crash cannot leave
half done; ``consolidate.to_full`` still writes its one file in place);
``zerofn/runtime/agree.py`` is the cross-rank agreement every collective entry point
here starts with.
"""
