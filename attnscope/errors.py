"""Errors the core raises. Each carries a one-line message a user can act on.

The CLI maps them to exit codes: a `UsageError` (a bad option, file or shape: something the user
typed) exits 2, any other `AttnscopeError` (a failure at run time) exits 1.
"""

from __future__ import annotations


class AttnscopeError(Exception):
    """Base of every error attnscope raises on purpose; its message is one line for the user."""

    exit_code = 1


class UsageError(AttnscopeError):
    """A bad option, argument, file or shape: what the user asked for cannot be done as asked."""

    exit_code = 2


class ResourceError(AttnscopeError):
    """The run would not fit in memory, or a model could not be found or loaded."""

    exit_code = 1
