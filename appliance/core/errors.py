"""One exception base for everything a user can get wrong; the CLI prints it as one line."""


class ApplianceError(Exception):
    """A problem the user can act on. str(err) is the single line the CLI prints."""

    exit_code = 2


class ConfigError(ApplianceError):
    """A config file or a command-line value is invalid (names the file and the key)."""


class DataError(ApplianceError):
    """Input data is unreadable or malformed (names the file and the position)."""


class EnvironmentProblem(ApplianceError):
    """Something this box lacks (a tool, a package, disk space)."""


class GateFailed(ApplianceError):
    """A quality gate failed (data check, quantize accuracy, edge agreement): the figures are in its report."""

    exit_code = 3
