"""The error raised when a data set is not on this machine."""


class DatasetNotAvailableError(FileNotFoundError):
    """A known data set whose files are not on this machine.

    The message says what to install (or where to put files) to make it available.
    """
