"""The commands of `attnscope`, each module imported only when its command is run or listed.

`attnscope head ...` imports attnscope/cli/head.py and nothing of sdpa's, trace's or anatomy's modules (what each
imports at its top, render's tables and usertrace included). The root group's `commands` is a `Commands`
mapping: its keys are every command's name, in the order `attnscope --help` lists them, and a command is built
the first time it is looked up (Click's own route: `Group.get_command`). Listing the names, and Typer's "Did you
mean 'head'?", build none; `--help` builds them all, as it did when every module was imported up front.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from importlib import import_module
from typing import Any

# Command name -> the module under attnscope/cli/ whose `register(app)` declares it, in the order of --help
# (Typer's: the commands, then the sub-apps).
COMMANDS = {"sdpa": "sdpa", "mha": "mha", "mask": "mask", "bert": "bert", "head": "head", "trace": "trace",
            "anatomy": "anatomy", "diff": "diff", "bench": "bench"}


def build(name: str) -> Any:
    """The Click command `name`, as Typer builds it from the command's module: `register` declares it on an app
    of its own, with the root's markup mode, and `typer.main.get_command` builds it (a group holding it where
    the module adds a sub-app, as bench does)."""
    import typer

    app = typer.Typer(rich_markup_mode="rich", add_completion=False)
    import_module(f"attnscope.cli.{COMMANDS[name]}").register(app)
    built = typer.main.get_command(app)
    return built if built.name == name else built.commands[name]  # type: ignore[attr-defined]


class Commands(MutableMapping[str, Any]):
    """A group's commands by name, each built on first access by `load(name)` (then `dress(command)`)."""

    def __init__(self, given: MutableMapping[str, Any], names: list[str], load: Callable[[str], Any],
                 dress: Callable[[Any], None]) -> None:
        self._built = dict(given)
        self._names = [*given, *(name for name in names if name not in given)]
        self._load, self._dress = load, dress

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in self._names:
                raise KeyError(name)
            command = self._load(name)
            self._dress(command)
            self._built[name] = command
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command
        if name not in self._names:
            self._names.append(name)

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)
