"""The exceptions hisparse raises. The Rust core maps each of its error kinds onto one of these."""


class HiSparseError(Exception):
    """Base class of every hisparse error."""


class ConfigError(HiSparseError, ValueError):
    """The configuration cannot work; the message says what to change."""


class CapacityError(HiSparseError):
    """Not enough of a resource right now; nothing changed.

    ``resource`` is ``"gpu"``, ``"host"`` or ``"slots"``; ``needed`` and ``available`` count its blocks.
    """

    resource: str
    needed: int
    available: int


class InvalidArgumentError(HiSparseError, ValueError):
    """A caller passed something that cannot be right; nothing changed."""


class UnknownRequestError(HiSparseError, KeyError):
    """The request id is not (or no longer) known."""

    request_id: int

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class InvariantError(HiSparseError, AssertionError):
    """An internal invariant does not hold: a bug in hisparse, never the caller's fault."""
