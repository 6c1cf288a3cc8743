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


HF = "hf:"  # --model hf:PATH, a Hugging Face model folder (models/hf.py)


def is_hf_folder(name: str) -> bool:
    """`hf:PATH`: a transformers model built from the config.json in folder PATH."""
    return isinstance(name, str) and name.startswith(HF) and len(name) > len(HF)


def is_own_network(name: str) -> bool:
    """A network of the user's named by --model (an import path or a Hugging Face folder), not the registry's."""
    return is_import_path(name) or is_hf_folder(name)


def is_file(head: str) -> bool:
    return head.endswith(".py") or "/" in head or "\\" in head


def absolute(name: str) -> str:
    """The name with a relative file path made absolute (config.yaml must name the same file or folder from any
    folder); a module path is kept as given."""
    if is_hf_folder(name):
        return HF + str(Path(name[len(HF):]).expanduser().resolve())
    head, _, tail = name.rpartition(":")
    return f"{Path(head).expanduser().resolve()}:{tail}" if is_file(head) else name
