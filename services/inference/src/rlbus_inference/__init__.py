"""rlbus_inference."""
