"""Errors the core raises. Each carries a one-line message a user can act on, with any control character in it
(a name or path echoed from the user or a file) escaped.

The CLI maps them to exit codes: a `UsageError` (a bad option, file or shape: something the user
typed) exits 2, any other `AttnscopeError` (a failure at run time) exits 1. Messages name parameters as a
Python caller writes them (`window`); the command line words them as flags (`--window`, cli/errors.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# What a terminal would act on rather than show: C0 controls (ESC starts a colour or a cursor move; tab and line
# feed are spacing), DEL, C1 controls, and Unicode's bidirectional overrides and isolates (which reorder a line).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` (a name or path read from the user or a file) safe to echo: every control character escaped as
    Python writes it in a string (ESC as `\\x1b`), so a message never colours, moves or rewrites the terminal."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class AttnscopeError(Exception):
    """Base of every error attnscope raises on purpose; its message is one line for the user.

    A message about parameters names each as `{name}` and lists them after it: `UsageError("{window} 0: a query
    must see at least itself", "window")`. `str()` puts the parameter's own name there (what a Python caller
    writes), `worded(flags)` what the caller calls it (the command line: `--window`)."""

    exit_code = 1

    def __init__(self, template: str = "", *params: str) -> None:
        self.template, self.params = template, params
        super().__init__(self.worded({}))

    def worded(self, names: Mapping[str, str]) -> str:
        """The message, each parameter named as `names` says, control characters escaped (`printable`)."""
        text = self.template
        for param in self.params:
            text = text.replace("{" + param + "}", names.get(param, param))
        return printable(text)


class UsageError(AttnscopeError):
    """A bad option, argument, file or shape: what the user asked for cannot be done as asked."""

    exit_code = 2


class ResourceError(AttnscopeError):
    """The run would not fit in memory, or a model could not be found or loaded."""

    exit_code = 1
