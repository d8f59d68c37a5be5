"""Errors raised by the bus layer."""


class BusError(Exception):
    """Base of rlbus bus errors."""


class BusAuthError(BusError):
    """The NATS server refused our credentials."""


class BusConnectError(BusError):
    """No NATS server answered at the configured URL."""


class BusTLSError(BusConnectError):
    """TLS could not be set up with the server (it offers none, or its certificate is not trusted);
    never retried and never downgraded to plaintext."""


class ClaimCheckError(BusError):
    """A claim-check payload is missing or does not match its recorded size/sha256."""


class StepNotFound(BusError, TimeoutError):
    """The step log has no batch for the step within the timeout."""


class LeaseHeld(BusError):
    """Another holder owns the lease."""


class CasMismatch(BusError):
    """A KV compare-and-set found a different revision."""


class PoisonBatch(BusError):
    """A step-log entry that cannot be turned into a `TrainBatch` (undecodable bytes, a missing or
    corrupt claim check). Carries the stored message so the trainer can dead-letter it as is."""

    def __init__(
        self, step: int, subject: str, data: bytes, headers: dict[str, str], reason: str
    ) -> None:
        super().__init__(f"batch of step {step} at {subject}: {reason}")
        self.step = step
        self.subject = subject
        self.data = data
        self.headers = headers
        self.reason = reason
