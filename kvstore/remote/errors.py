"""What the remote tier raises."""


class RemoteError(Exception):
    """The remote cannot be used: network, timeout, credentials, bucket, permissions."""


class RemoteUnavailable(RemoteError):
    """The circuit breaker is open: the remote failed repeatedly and is skipped."""


class RemoteCorrupt(Exception):
    """An object of the remote failed validation."""


class NotFound(Exception):
    """The object does not exist (a miss, not a failure)."""
