"""The exceptions a user sees. Every message names the file, key or field, and the reason."""


class MergerError(ValueError):
    """Base class: bad input that the user can fix."""


class CheckpointError(MergerError):
    """A weights file is missing, corrupt, unsafe, or does not match the base."""


class PoolError(MergerError):
    """A pool description (YAML) is invalid or refers to something that is not there."""


class MethodError(MergerError):
    """An unknown method, or a parameter that is unknown, out of range or not a number."""


class DataError(MergerError):
    """Task data is missing, empty, or does not match the task's classes."""


class Cancelled(MergerError):
    """The user cancelled a long operation (a run, a preparation, a fine-tune); nothing was cached
    or written."""
