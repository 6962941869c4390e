"""Errors a user can act on.

Every error raised for a bad config or bad input is a ``UserError``: the CLI prints its message
as one line and exits with code 2, without a traceback. The message names the field or feature
and says what is allowed.
"""


class UserError(Exception):
    """A problem the user can fix: bad config, bad data, missing dependency."""

    exit_code = 2


class ConfigError(UserError):
    """A config field has a bad value; the message starts with the dotted field path."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class DataError(UserError):
    """Input data is malformed; the message names the feature and the first offending row."""

    def __init__(self, feature: str, message: str | None = None):
        self.feature = feature
        # One-argument form: torch's DataLoader re-raises worker errors as exc_type(text).
        super().__init__(feature if message is None else f"data feature '{feature}': {message}")


class NumericalFault(UserError):
    """Training produced a non-finite loss or gradient (train.nonfinite=stop): the message names
    the step, the first non-finite tensor and the batch's sample ids. Exit code 3."""

    exit_code = 3


def first_line(exc: BaseException) -> str:
    """The actionable line of an error. An error raised in a DataLoader worker arrives wrapped
    in the worker's traceback; its last line holds the original message."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if "Original Traceback" in lines[0] or lines[0].startswith("Caught "):
        return lines[-1].split(": ", 1)[-1]
    return lines[0]


def report_error(exc: UserError, who: str = "gemctl") -> int:
    """Print a user error as its one line on stderr; returns its exit code."""
    import sys

    print(f"{who}: error: {first_line(exc)}", file=sys.stderr)
    return exc.exit_code
