"""rlbus."""
