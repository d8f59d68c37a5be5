"""rlbus_trainer."""
