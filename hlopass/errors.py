"""Exceptions raised by hlopass."""


class ConfigError(ValueError):
    """A setting (environment variable or keyword argument) has a bad value.

    The message names the setting, the value given and the accepted forms.
    """


class MemoryLimitError(RuntimeError):
    """The compiled program needs more memory than ``memory_limit`` allows.

    Raised only in strict mode (``strict=True`` or ``HLOPASS_STRICT=1``);
    otherwise the same finding is logged as a warning.
    """

    def __init__(self, message: str, check=None):
        super().__init__(message)
        self.check = check


class ConfigWarning(UserWarning):
    """An environment variable named like a hlopass setting (``HLOPASS_*``) that hlopass does not
    know, a misspelling most likely: it is ignored. Warned once per name."""
