"""Observers of the runtime's events (runtime/events.py): the TensorBoard monitor
(tensorboard.py, with ``zf.log`` in log.py) and the failure watch (failures.py). Each
registers itself when imported; the runtime never imports them. Nothing in core/,
runtime/ or state/ imports this folder."""
