"""The one exception type that reaches users as a one-line message instead of a traceback."""

import errno


class UserError(Exception):
    """A problem with the user's input (flag, file, data, checkpoint): print one line, exit with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Unreadable(UserError):
    """A checkpoint that cannot be read (cut short, damaged, another kind of file): `reason` says why, apart from
    the advice to use another one, so that a caller that falls back on another one by itself (or finds none left)
    says the reason alone, with its own words of what happens or what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; use another one")
        self.reason = reason


class NeedsFactory(UserError):
    """A checkpoint of a network of the user's was asked for without the factory that builds it: each caller
    says how to give it in its own terms (model=make_net in Python, --model FILE.py:FACTORY on the command line)."""

    def __init__(self, run: object) -> None:
        super().__init__(f"{run} holds a network of your own: pass its factory, model=make_net")
        self.run = run


class NeedsNoFactory(UserError):
    """A factory was given for a checkpoint of a built-in network, and builds something its weights do not fit:
    each caller says to leave it out in its own terms (model= in Python, --model on the command line)."""

    def __init__(self, run: object, model: str, factory: str) -> None:
        super().__init__(f"{run} holds a {model} (a built-in network), and the network {factory} builds does not "
                         "take its weights; leave out model= for a built-in network")
        self.run, self.model = run, model


def closest(name: str, names: object) -> str | None:
    """The one of `names` that `name` most likely misspells, or None."""
    import difflib

    names = [str(n) for n in names]  # type: ignore[attr-defined]
    same = [n for n in names if n.lower() == name.lower()]  # only the case differs
    if same:
        return same[0]
    found = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return found[0] if found else None


MAX_MESSAGE = 1000  # characters: a message may quote a value of the user's, which may be megabytes


def one_line(message: object) -> str:
    """A message as one line (some library errors span several: tarfile lists every method it tried), cut
    to MAX_MESSAGE characters."""
    line = " ".join(str(message).split())
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE] + " [... cut]"


class WriteFailed(UserError):
    """A file of the run directory could not be written: a full disk, a quota, a folder made read-only or
    removed. Not the user's input and not mended by a restart (the disk would be as full): exit 1. The
    training loop adds what was kept and how to go on (`then`)."""

    def __init__(self, path: object, cause: OSError, then: str = "") -> None:
        self.path, self.cause = path, cause
        name = errno.errorcode.get(cause.errno or 0)
        super().__init__(f"cannot write {path}: {cause.strerror or cause}" + (f" ({name})" if name else "")
                         + f"; {then or self.remedy() + ' (or pass another --out) and run again'}", code=1)

    def remedy(self) -> str:
        """What the user does about the cause, in a few words."""
        if self.cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return "free space"
        if self.cause.errno in (errno.ENOENT, errno.ENOTDIR):
            return "put the run folder back"
        return "make the run folder writable again"


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, one it was raised from, or one a RuntimeError was raised while
    handling (torch.save reports a failed write so: "[enforce fail at inline_container.cc] unexpected pos").
    Other errors raised while handling an OSError are not write failures."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or (current.__context__ if isinstance(current, RuntimeError) else None)
    return None
