"""Whether a model name is an import path (`package.module:factory`, `path/to/file.py:factory`), and its
absolute form: plain string work, without torch, for config.validate (models/imported.py resolves it)."""

from __future__ import annotations

from pathlib import Path


def is_import_path(name: str) -> bool:
    """`module:factory` or `file.py:factory` (a registry name has no colon; a Windows drive's is not it)."""
    if not isinstance(name, str):
        return False
    head, sep, tail = name.rpartition(":")
    return bool(sep and head and tail and tail.isidentifier() and not (len(head) == 1 and head.isalpha()))


def is_file(head: str) -> bool:
    return head.endswith(".py") or "/" in head or "\\" in head


def absolute(name: str) -> str:
    """The name with a relative file path made absolute (config.yaml must name the same file from any
    folder); a module path is kept as given."""
    head, _, tail = name.rpartition(":")
    return f"{Path(head).expanduser().resolve()}:{tail}" if is_file(head) else name
