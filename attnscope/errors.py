"""Errors the core raises. Each carries a one-line message a user can act on.

The CLI maps them to exit codes: a `UsageError` (a bad option, file or shape: something the user
typed) exits 2, any other `AttnscopeError` (a failure at run time) exits 1. Messages name parameters as a
Python caller writes them (`window`); the command line words them as flags (`--window`, cli/errors.py).
"""

from __future__ import annotations

from collections.abc import Mapping


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
        text = self.template
        for param in self.params:
            text = text.replace("{" + param + "}", names.get(param, param))
        return text


class UsageError(AttnscopeError):
    """A bad option, argument, file or shape: what the user asked for cannot be done as asked."""

    exit_code = 2


class ResourceError(AttnscopeError):
    """The run would not fit in memory, or a model could not be found or loaded."""

    exit_code = 1
