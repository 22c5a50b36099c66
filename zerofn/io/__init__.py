"""Files and formats: checkpoints, Hugging Face weights, consolidation, atomic placement.

Dependency rule: io persists through the state-dict verbs and the runtime's public
surface (``Runtime``'s docstring lists it); it never touches hooks or buffers.
``checkpoint/`` reads and writes ``zerofn.state_dict``'s state dicts (``staging.py``
borrows the runtime's pinned host allocator for its staging copy); ``pretrained/``
streams each unit's master rows through ``Runtime.gather_unit`` and writes them back
through the slots ``Runtime.slots_by_name`` names, between ``prepare_state_dict`` and
``refresh_params``.

``weights.py`` streams the full weights out in buckets (``zf.full_weights``), reading
offloaded state a unit at a time as ``checkpoint/streamed.py`` does.

``fs.py`` puts finished files and directories in place (renames a crash cannot leave
half done; ``consolidate.to_full`` still writes its one file in place), and reaches a
checkpoint at an fsspec URL (``s3://``, ``memory://``) through fsspec, a path through ``os``;
``zerofn/runtime/agree.py`` is the cross-rank agreement every collective entry point
here starts with.
"""
