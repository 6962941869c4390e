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
