"""Storage URLs as they may be shown: a password never reaches a line, a file or a log."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"


def password_of(url: str) -> str | None:
    try:
        password = urlsplit(url).password
    except ValueError:  # a malformed port, say: no password can be told apart
        return None
    return password or None


def masked(url: str) -> str:
    """`url` with its password replaced by ***: postgresql://alice:***@host/db."""
    password = password_of(url)
    if password is None:
        return url
    parts = urlsplit(url)
    user, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{user.split(':', 1)[0]}:{MASK}@{host}"))


def scrubbed(text: str, url: str) -> str:
    """`text` (a driver's error message, say) with `url`'s password taken out, in every spelling."""
    password = password_of(url)
    if password is None:
        return text
    for spelling in {password, unquote(password)}:
        text = text.replace(spelling, MASK)
    return text.replace(url, masked(url))
