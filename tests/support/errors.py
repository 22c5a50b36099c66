"""Expected errors: raised, and saying what they must."""
from __future__ import annotations


def error_of(fn, *args, error=ValueError, **kw) -> str | None:
    """The message of the ``error`` that ``fn(*args, **kw)`` raises; None where it raises
    none. Ranks return it, so that the test sees what every rank said."""
    try:
        fn(*args, **kw)
    except error as e:
        return str(e)
    return None


def expect_error(fragments, fn, *args, error=ValueError, **kw) -> str:
    """Run ``fn(*args, **kw)``; it must raise ``error`` whose message holds every one of
    ``fragments``. Returns the message."""
    message = error_of(fn, *args, error=error, **kw)
    assert message is not None, f"{getattr(fn, '__name__', fn)} raised no {error.__name__}"
    assert all(f in message for f in fragments), (fragments, message)
    return message
