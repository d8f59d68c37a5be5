"""Errors raised by the bus layer."""


class BusError(Exception):
    """Base of rlbus bus errors."""


class BusAuthError(BusError):
    """The NATS server refused our credentials."""


class BusConnectError(BusError):
    """No NATS server answered at the configured URL."""


class ClaimCheckError(BusError):
    """A claim-check payload is missing or does not match its recorded size/sha256."""


class StepNotFound(BusError, TimeoutError):
    """The step log has no batch for the step within the timeout."""


class LeaseHeld(BusError):
    """Another holder owns the lease."""


class CasMismatch(BusError):
    """A KV compare-and-set found a different revision."""
