"""The one exception type that reaches users as a one-line message instead of a traceback."""


class UserError(Exception):
    """A problem with the user's input (flag, file, data, checkpoint): print one line, exit with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def closest(name: str, names: object) -> str | None:
    """The one of `names` that `name` most likely misspells, or None."""
    import difflib

    found = difflib.get_close_matches(name, [str(n) for n in names], n=1, cutoff=0.6)  # type: ignore[attr-defined]
    return found[0] if found else None


MAX_MESSAGE = 1000  # characters: a message may quote a value of the user's, which may be megabytes


def one_line(message: object) -> str:
    """A message as one line (some library errors span several: tarfile lists every method it tried), cut
    to MAX_MESSAGE characters."""
    line = " ".join(str(message).split())
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE] + " [... cut]"
