"""The one exception type that reaches users as a one-line message instead of a traceback."""


class UserError(Exception):
    """A problem with the user's input (flag, file, data, checkpoint): print one line, exit with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def one_line(message: object) -> str:
    """A message as one line: some library errors span several (tarfile lists every method it tried)."""
    return " ".join(str(message).split())
