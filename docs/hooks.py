"""MkDocs hook: the flags reference (reference/cli.md) is generated from paratrain's own parser at build
time, so a flag added, renamed or re-described in the code is what the site shows; nothing is copied by hand.

A page asks for it with the line `<!-- paratrain-commands -->`.
"""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- paratrain-commands -->"
TRAINING = ("train", "search", "bench", "submit")  # the commands whose flags are TrainConfig's fields
TITLES = {"options": "Options", "optional arguments": "Options", "positional arguments": "Arguments"}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, commands_markdown())


def commands_markdown() -> str:
    """A section per command, in --help's order: what it does, its usage, a table of its flags per group."""
    from paratrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    parts = []
    for name, command in sub.choices.items():
        parts.append(f"## paratrain {name}\n")
        parts.append(f"{_text(helps.get(name) or command.description or '')}\n")
        usage = command.format_usage().removeprefix("usage: ").strip()
        parts.append(f"```text\n{usage}\n```\n")
        for group in command._action_groups:
            rows = [_row(a, name in TRAINING) for a in group._group_actions
                    if not isinstance(a, argparse._HelpAction)]
            if not rows:
                continue
            parts.append(f"**{TITLES.get(group.title or '', group.title or 'Options')}**\n")
            parts.append("| flag | default | what it does |\n| --- | --- | --- |")
            parts.extend(rows)
            parts.append("")
    return "\n".join(parts)


def _row(action: argparse.Action, training: bool) -> str:
    from paratrain import config as C

    flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    choices = action.choices
    if training and choices is None and action.dest == "model":  # a registry name, or your own
        choices = [*C.FIELDS["model"].metadata.get("choices", ()), "FILE.py:FACTORY", "package.module:FACTORY"]
    if choices is not None and not isinstance(action, argparse._SubParsersAction):
        flag += "<br>" + " \\| ".join(f"`{c}`" for c in choices if c != "custom")
    default = action.default
    if training and default is None and action.dest in C.FIELDS:  # None: "as the config file or recipe says"
        default = C.FIELDS[action.dest].default
    hidden = default is None or default is False or default in (argparse.SUPPRESS, "") or \
        isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction))
    shown = "" if hidden else f"`{default}`"
    return f"| {flag} | {shown} | {_text(action.help or '')} |"


def _text(help_text: str) -> str:
    """argparse's help, safe in a Markdown table cell: %% as argparse shows it, no pipes or angle brackets."""
    text = help_text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")
    return text.replace("<", "&lt;").replace(">", "&gt;")
