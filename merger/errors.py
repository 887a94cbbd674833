"""The exceptions a user sees. Every message names the file, key or field, and the reason."""


class MergerError(ValueError):
    """Base class: bad input that the user can fix."""


class CheckpointError(MergerError):
    """A weights file is missing, corrupt, unsafe, or does not match the base."""


class PoolError(MergerError):
    """A pool description (YAML) is invalid or refers to something that is not there."""


class MethodError(MergerError):
    """An unknown method, or a parameter that is unknown, out of range or not a number. A refused
    value also carries the parameter's name and the reason alone, for a front end that names the
    field its own way (the Merge tab: by the control's label)."""

    def __init__(self, message: str, param: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.param, self.reason = param, reason


class DataError(MergerError):
    """Task data is missing, empty, or does not match the task's classes."""


class Cancelled(MergerError):
    """The user cancelled a long operation (a run, a preparation, a fine-tune); nothing was cached
    or written."""


class Unfollowed(Cancelled):
    """This caller cancelled a run or a preparation that another caller of the same settings still
    follows: it goes on for that one, and is cached when done."""


def shown_value(value: object) -> str:
    """A value as a message quotes it, at most 60 characters (an integer of thousands of digits, which
    repr refuses past 4,300, said by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 190:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'over 4,000'} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def listed(names, most: int = 10, width: int = 60) -> str:
    """Names a person gave, for a message: at most ``most`` of them, each cut at ``width``
    characters (a script's 20,000 names, or one of 100,000 characters, must not become the message)."""
    names = [n if isinstance(n, str) else shown_value(n) for n in names]
    shown = ", ".join(n if len(n) <= width else n[:width] + "…" for n in names[:most])
    return shown + (f", … ({len(names)} in all)" if len(names) > most else "")
