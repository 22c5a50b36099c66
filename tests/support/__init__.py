"""What the tests share: models, the multi-rank launcher, training loops, comparisons.

Test files import helpers from here, never from one another (tests/test_layout_of_tests.py
checks it), so each test file stands on its own. A function run on ranks
(``ranks.run_ranks``) must be module-level in an importable module, here or in a test
file: the ranks import it by name. tests/conftest.py puts tests/ on ``sys.path``, so this
package is ``support``.
"""
from __future__ import annotations

import os

# ZEROFN_SLOW=1 runs the slow variants (tests marked ``slow``) and the larger settings of
# some tests (more drawn examples in test_properties, every case at every stage in
# test_deepspeed_convert).
SLOW = os.environ.get("ZEROFN_SLOW") == "1"


def slow_variant(*values, covered_by: str):
    """A parametrized case (``values``) that runs only with ZEROFN_SLOW=1, because
    ``covered_by``, a faster test that runs every time, covers the same behaviour; the skip
    names it."""
    import pytest   # here: the jobs and scripts that import support need no pytest
    return pytest.param(*values, marks=pytest.mark.slow(reason=f"covered in every run by "
                                                               f"{covered_by}"))
