"""Errors the engine raises, each carrying enough to tell the user what to do."""


class ConvergeError(Exception):
    """Base class: the message is meant for a person and is printed as it is."""


class InventoryError(ConvergeError):
    """The inventory cannot be read or does not validate.

    ``problems`` holds one line per problem, each ``file:line: key.path: what``.
    """

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ConnectionFailed(ConvergeError):
    """A host could not be reached or refused us; the host is unreachable."""


class HostKeyError(ConnectionFailed):
    """The host's key is unknown or differs from known_hosts."""


class RemoteCommandError(ConvergeError):
    """A remote command failed; carries its exit code and output."""

    def __init__(self, message, rc=None, output=""):
        self.rc = rc
        self.output = output
        super().__init__(message)


class StepFailed(ConvergeError):
    """A role step decided the host cannot go on (e.g. a failed precheck)."""


class SecretError(StepFailed):
    """A secret file on the control machine cannot be used (missing, too open, not one line)."""


class BecomeRefused(ConvergeError):
    """sudo would not run our scripts (wrong or missing password, not allowed)."""
