"""The errors a collective raises on every rank instead of hanging or corrupting."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout: a peer died, hung, or diverged."""


class CollectiveMismatchError(RuntimeError):
    """The ranks posted different collectives (a rank-dependent branch around a collective, or
    ranks that ran different numbers of steps): comm/agreement.py."""
