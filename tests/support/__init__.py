"""What the tests share: models, the multi-rank launcher, the torchrun jobs.

Test files import helpers from here. A function run on ranks (``ranks.run_ranks``) must be
module-level in an importable module, here or in a test file: the ranks import it by
name. tests/conftest.py puts tests/ on ``sys.path``, so this package is ``support``.
"""
