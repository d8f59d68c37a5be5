"""Fixtures of the end-to-end tests (helpers live in e2e_support.py)."""

from e2e_support import starting_model  # noqa: F401  (session fixture)
