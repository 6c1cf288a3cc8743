"""Where the user's code failed: the frame of a traceback that is the user's (not Python's, torch's or
paratrain's), for one-line errors that name the user's line ("at mine.py:13 in forward: ...")."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

from .errors import UserError


def _libraries() -> tuple[str, ...]:
    """Where code that is not the user's lives: Python's standard library, installed packages, paratrain."""
    import importlib.util
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(site.getsitepackages()) | {site.getusersitepackages()}  # pip --user, Debian's dist-packages
    paths.add(str(Path(__file__).resolve().parents[1]))  # the package, not just core/
    torch = importlib.util.find_spec("torch")  # where it is, without importing it (an editable torch, say)
    if torch is not None and torch.origin:
        paths.add(str(Path(torch.origin).parent))
    return tuple(str(Path(p).resolve()) + os.sep for p in paths)


_LIBRARIES = _libraries()


def _is_library(filename: str) -> bool:
    """Code that is not the user's: under a library folder, or Python's own (<frozen ...>, <string>)."""
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_LIBRARIES)


def user_frame(tb: Any) -> str:
    """Where the user's code failed: the last frame of a traceback outside torch and paratrain ("" if none)."""
    frames = [f for f in traceback.extract_tb(tb) if not _is_library(f.filename)]
    return _where(frames[-1].filename, frames[-1].lineno, frames[-1].name, frames[-1].line) if frames else ""


def user_frame_in_text(text: str) -> str:
    """The same, from a traceback as text (a worker's, which reaches this process as a string)."""
    import re

    found = ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r'\s*File "(.+)", line (\d+), in (.+)', line)
        if m and not _is_library(m.group(1)):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = _where(m.group(1), int(m.group(2)), m.group(3), code)
    return found


def _where(filename: str, lineno: int | None, name: str, code: str | None) -> str:
    return f"{Path(filename).name}:{lineno} in {name}" + (f": {code.strip()}" if code else "")


def failed(what: str, e: BaseException) -> UserError:
    where = user_frame(e.__traceback__)
    return UserError(f"{what}: {type(e).__name__}: {e}" + (f" (at {where})" if where else ""))


def name_of(factory: Any) -> str:
    """A factory's name as its code spells it (a class, a function, a lambda), without the enclosing
    function's "<locals>" path."""
    return getattr(factory, "__qualname__", type(factory).__name__).rsplit("<locals>.", 1)[-1]
