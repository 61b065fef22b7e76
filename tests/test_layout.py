"""The house's layout, read from every module's imports (docs/architecture.md): the top level holds the shared
vocabulary and nothing else, variants/ reads no spec, check/ imports nothing of attention/, no module is part
of an import loop, the sub-folders of a wing import without a loop, models/' folders import in one order, and
models/' root imports none of them but gguf/. Every import counts, those inside functions and under TYPE_CHECKING
too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import attnscope

PACKAGE = Path(attnscope.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing(name: str) -> str:
    """`attnscope.check.rope` -> `check` (the package's own modules: themselves)."""
    return name.split(".")[1] if "." in name else name


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The attnscope modules `path` imports: `from attnscope.x import y` names y where y is a module, else x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("attnscope")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnscope"):
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if inner in known else node.module)
    return found


def imported_by_name(path: Path, known: dict[str, Path]) -> set[str]:
    """The attnscope modules `path` imports by name at run time: `import_module("attnscope.x.y")` names that one,
    `import_module(f"attnscope.x.{name}")` every module below attnscope.x (any may be asked for)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "import_module" and node.args):
            continue
        arg = node.args[0]
        head = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("attnscope"):
            found |= ({head.value} & set(known) if head is arg else
                      {name for name in known if name.startswith(head.value) and name != head.value.rstrip(".")})
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target in imports(path, known) if target in known and target != name}
            for name, path in known.items()}


def test_the_top_level_is_the_shared_vocabulary() -> None:
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "cost", "errors", "masks", "spec", "trace", "words"]


def test_check_imports_nothing_of_attention() -> None:
    arrows = graph()
    wrong = {(name, target) for name, targets in arrows.items() if wing(name) == "check"
             for target in targets if wing(target) == "attention"}
    assert not wrong
    assert sum(wing(name) == "check" for name in arrows) > 1  # the test reads the wing it guards


def test_variants_read_no_spec_and_record_no_step() -> None:
    arrows = graph()
    for name, targets in arrows.items():
        if wing(name) == "variants":
            assert {wing(t) for t in targets} <= {"errors", "variants"}, name


def test_the_core_never_imports_the_views() -> None:
    arrows = graph()
    for name in ("attnscope.trace", "attnscope.spec", "attnscope.masks", "attnscope.cost", "attnscope.errors"):
        assert not {t for t in arrows[name] if wing(t) in ("views", "readings", "render", "runs", "cli")}


def loops_in(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in arrows[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for name in sorted(arrows):
        if name not in index:
            visit(name)
    return loops


def test_no_import_loop() -> None:
    """Every strongly connected component a single module."""
    assert not loops_in(graph())


def folder(name: str) -> str:
    """The folder a module lives in, below its wing: `attnscope.models.families.llama` -> `models/families`,
    `attnscope.models.family` -> `models` (a wing's root; the top level's modules: themselves)."""
    parts = name.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return "/".join(parts if path.is_dir() else parts[:-1]) or name


def folder_arrows(wing_name: str) -> dict[str, list[tuple[str, str]]]:
    """`(from folder, to folder)` -> the module imports that make it, for the folders of one wing."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name, targets in graph().items():
        if wing(name) != wing_name:
            continue
        for target in targets:
            if wing(target) == wing_name and folder(target) != folder(name):
                found.setdefault(f"{folder(name)} -> {folder(target)}", []).append((name, target))
    return found


def test_no_wing_has_a_loop_between_its_folders() -> None:
    """A module may import within its folder freely; between the folders of a wing, no loop (models/: root ->
    nopage -> forward -> families -> root and root <-> gguf once)."""
    wings = {wing(name) for name in modules()}
    for name in sorted(wings):
        arrows: dict[str, set[str]] = {}
        for edge in folder_arrows(name):
            start, end = edge.split(" -> ")
            arrows.setdefault(start, set()).add(end)
            arrows.setdefault(end, set())
        assert not loops_in(arrows), (name, folder_arrows(name))


# models/' folders, top to bottom: each imports only those below it (and itself), docs/architecture.md
MODELS_ORDER = ["models/vision", "models/forward", "models/families", "models/nopage", "models", "models/gguf"]


def test_models_folders_import_downwards() -> None:
    folders = {folder(name) for name in modules() if wing(name) == "models"}
    assert folders == set(MODELS_ORDER)  # a new folder takes its place in the order
    up = {edge: imports for edge, imports in folder_arrows("models").items()
          if MODELS_ORDER.index(edge.split(" -> ")[0]) > MODELS_ORDER.index(edge.split(" -> ")[1])}
    assert not up


def test_the_models_root_imports_none_of_its_folders() -> None:
    """models/' root is the protocol and the reading (family, weights, config, checkpoint, tokenizer, hub): it
    imports none of its folders, by an import or by a name given to import_module (which page reads a checkpoint
    is families/' to say), but gguf/, the GGUF reader that its readers open."""
    known = modules()
    below = {name: graph()[name] | imported_by_name(known[name], known) for name in known
             if wing(name) == "models" and folder(name) == "models"}
    wrong = {(name, target) for name, targets in below.items() for target in targets
             if wing(target) == "models" and folder(target) not in ("models", "models/gguf")}
    assert not wrong
    assert "attnscope.models.family" in below  # the test reads the root it guards


def test_models_imports_only_what_lies_below_it() -> None:
    """models/ imports the top level, variants/, attention/, check/ (the references it holds a run against),
    tensors/, views/ and readings/ (docs/architecture.md); never runs/, render/, cli/, usertrace/ or anatomy/."""
    top = {path.stem for path in PACKAGE.glob("*.py")}
    allowed = top | {"models", "variants", "attention", "check", "tensors", "views", "readings"}
    wrong = {(name, target) for name, targets in graph().items() if wing(name) == "models"
             for target in targets if wing(target) not in allowed}
    assert not wrong


def test_the_stages_read_only_the_vocabulary() -> None:
    """attention/stages.py, the stages a page's attention method calls (docs/architecture.md), imports the top level,
    variants/ and the thread count of its products (tensors/weight_threads.py), and of attention/ only the check of
    sdpa's sink values (sinks.py): a page and stages.py are the attention's whole text."""
    top = {f"attnscope.{name}" for name in ("trace", "masks", "spec", "cost", "errors", "words")}
    allowed = top | {"attnscope.tensors.weight_threads", "attnscope.attention.sinks"}
    stages = graph()["attnscope.attention.stages"]
    assert {t for t in stages if wing(t) != "variants"} <= allowed, stages
