"""rlbus_orchestrator."""
