"""Option types shared by several commands, declared once (the house style's aliases), and the classes
that make every command's help read right: `-h` as `--help`, flags shown as flags."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

HELP_NAMES = ["-h", "--help"]  # `-h` works as --help everywhere (set on the root, inherited by every command)


class Causal(str, Enum):
    upper_left = "upper-left"
    lower_right = "lower-right"


class Pairing(str, Enum):
    half_split = "half-split"
    interleaved = "interleaved"


class WindowSideChoice(str, Enum):
    left = "left"
    both = "both"


class QkNormPlace(str, Enum):
    head = "head"
    proj = "proj"


class Layout(str, Enum):
    row = "row"
    col = "col"


class AttentionCommand(TyperCommand):
    """Lets `--causal`, `--sinks` and `--qk-norm` stand alone: a bare `--causal` means `--causal upper-left`, as
    `is_causal=True`, a bare `--sinks` means `--sinks random`, a bare `--qk-norm` means `--qk-norm head`; and
    refuses an option typed where it would be silently ignored (`refuse_ignored`)."""

    def parse_args(self, ctx, args):  # type: ignore[no-untyped-def]
        ctx.meta[BARE_GIVEN] = bare_flags(list(args))  # a bare --causal is told apart from --causal upper-left
        rest = super().parse_args(ctx, expand_bare_causal(list(args)))
        refuse_ignored(ctx)
        return rest


# Options that apply only to random inputs, per command, and the file options that replace those inputs.
# mha's weights stay random with --q, so its --seed still counts.
RANDOM_ONLY = {"sdpa": (("q", "x"), ("batch", "nq", "nk", "dk", "dv", "seed")),
               "mha": (("q",), ("batch", "nq", "nk", "d_feat"))}
HEATMAP_ONLY = ("heatmap_batch", "heatmap_head")


def refuse_ignored(ctx) -> None:  # type: ignore[no-untyped-def]
    """A size typed with file inputs, or --heatmap-batch/--heatmap-head without --heatmap (--heatmap-batch:
    or --all-heads), would change nothing: refused in one line (exit 2) rather than dropped without a word."""
    from attnscope.cli.errors import ClickUsageError

    typed = {p.name: p.opts[0] for p in ctx.command.params
             if p.name and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"}
    files, sizes = RANDOM_ONLY.get(ctx.command.name, ((), ()))
    source = next((name for name in files if ctx.params.get(name)), None)
    ignored = [typed[name] for name in sizes if name in typed]
    if source and ignored:
        listed = " and ".join(ignored)
        raise ClickUsageError(f"{listed} only appl{'ies' if len(ignored) == 1 else 'y'} to random inputs, and "
                              f"--{source} reads the inputs from a file, which gives the sizes; drop {listed}", ctx)
    heatmap, all_heads = bool(ctx.params.get("heatmap")), bool(ctx.params.get("all_heads"))
    unused = [typed[name] for name in HEATMAP_ONLY
              if name in typed and not (heatmap or (name == "heatmap_batch" and all_heads))]
    if unused and all_heads:  # only --heatmap-head is left: --all-heads draws every head
        raise ClickUsageError("--heatmap-head chooses the head --heatmap draws, and --all-heads draws every head; "
                              "add --heatmap, or drop --heatmap-head", ctx)
    if unused:
        listed = " and ".join(unused)
        add = "--heatmap or --all-heads" if "all_heads" in ctx.params and unused == ["--heatmap-batch"] else "--heatmap"
        raise ClickUsageError(f"{listed} only choose{'s' if len(unused) == 1 else ''} what {add} draws; add {add}, "
                              f"or drop {listed}", ctx)


class AttnscopeGroup(TyperGroup):
    """The root command group. Its commands are cli/commands.py's, each module imported only when its command
    is run or listed. Typer 0.29 renders every flag in the help panels with a value type,
    `--check <bool>`, which invites `--check true` (then: "unexpected extra argument"); Typer 0.16 to 0.28
    showed flags bare. A flag given an empty metavar renders bare in all of them, so this group gives one
    to every flag of every command below it (their own, the help option, the completion options) as each
    command is built: commands added later are covered without doing anything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from attnscope.cli.commands import COMMANDS, build

        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            _dressed(command)
        self.commands = Commands(self.commands, list(COMMANDS), build, _dressed)
        if self.epilog:
            self.format_help = types.MethodType(_format_help_fitted, self)  # type: ignore[method-assign]

    def get_params(self, ctx: Any) -> list[Any]:  # a click Context (typer vendors click: its own class)
        params = super().get_params(ctx)  # the completion options are added after __init__
        _flags_as_flags(params)
        return params

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # the names alone: Typer's lists them by building each


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


def _dressed(command: Any) -> None:
    """A command of the root group, as it is built: flags shown as flags, its summary in one paragraph, its
    examples fitted to the width; the same for the commands below it (bench's)."""
    # The help option is made on first use and then kept (Click >= 8.2): make it now, with our names.
    help_option = command.get_help_option(typer.Context(command, help_option_names=HELP_NAMES))
    _flags_as_flags([*command.params, help_option])
    _flags_as_flags_below(command)
    _summary_in_one_paragraph(command)
    _summaries_in_one_paragraph(command)
    _examples_fitted(command)


def _flags_as_flags_below(group: Any) -> None:
    for command in getattr(group, "commands", {}).values():
        # The help option is made on first use and then kept (Click >= 8.2): make it now, with our names.
        help_option = command.get_help_option(typer.Context(command, help_option_names=HELP_NAMES))
        _flags_as_flags([*command.params, help_option])
        _flags_as_flags_below(command)


def _summaries_in_one_paragraph(group: Any) -> None:
    """Typer's command list in rich markup mode keeps the line breaks of a docstring's first paragraph, so
    `attnscope --help` broke sentences mid-way ("and write it for / F.scaled_dot_product_attention"): each
    command's summary is its first paragraph as one line, wrapped by Rich to the width."""
    for command in getattr(group, "commands", {}).values():
        _summary_in_one_paragraph(command)
        _summaries_in_one_paragraph(command)


def _summary_in_one_paragraph(command: Any) -> None:
    if command.short_help is None and command.help:
        first = inspect.cleandoc(command.help).partition("\f")[0].split("\n\n")[0]
        command.short_help = " ".join(first.split())


def _examples_fitted(command: Any) -> None:
    """Each command's help ends with examples; one longer than the help's width was wrapped by Rich at any space,
    inside a quoted sentence too (`--text "The cat sat on` | `the mat."`). Each is now fitted as the help is drawn
    (`fitted_examples`), the epilog itself left as written (tests/examples.py runs it)."""
    if command.epilog:
        command.format_help = types.MethodType(_format_help_fitted, command)
    for sub in getattr(command, "commands", {}).values():
        _examples_fitted(sub)


def _format_help_fitted(self: Any, ctx: Any, formatter: Any) -> None:
    import io
    import sys

    from attnscope.render.console import stream_width

    written = self.epilog
    self.epilog = fitted_examples(written, stream_width(sys.stdout) - 2)  # Typer pads the epilog by one column
    piped = not sys.stdout.isatty()
    shown, buffer = sys.stdout, io.StringIO()
    if piped:
        sys.stdout = buffer
    try:
        type(self).format_help(self, ctx, formatter)
    finally:
        self.epilog = written
        sys.stdout = shown
    if piped:  # Rich pads every line to the width: piped, no line ends in blanks (the console's own output too)
        sys.stdout.write(re.sub(" +\n", "\n", buffer.getvalue()))


_WORD = re.compile(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""")  # a shell word: its quoted parts whole


def fitted_examples(epilog: str, width: int) -> str:
    """`epilog` with each `attnscope ...` line wider than `width` broken between shell words, never inside
    quotes, as a command a shell still reads whole: each line but the last ends in ` \\`, the next starts four
    spaces in; a trailing `# comment` goes on a line of its own at the end."""
    lines = []
    for line in epilog.split("\n"):
        text = line.strip()
        if not text.startswith("attnscope ") or len(line) <= width:
            lines.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        command, comment = _split_comment(text)
        rows = [indent]
        for word in _WORD.findall(command):
            if rows[-1].strip() and len(rows[-1]) + 1 + len(word) + 2 > width:
                rows.append(indent + "    ")
            rows[-1] += (" " if rows[-1].strip() else "") + word
        if comment and len(rows[-1]) + 3 + len(comment) <= width:
            rows[-1] += "   " + comment
        elif comment:
            rows.append(indent + "    " + comment)
        lines.append(" \\\n".join(rows))
    return "\n".join(lines)


def _split_comment(text: str) -> tuple[str, str]:
    """`attnscope diff a b   # exit 1: ...` as the command and its comment (a `#` inside quotes is neither)."""
    unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", lambda m: "x" * len(m.group()), text)
    found = re.search(r"\s#", unquoted)
    return (text, "") if found is None else (text[: found.start()].rstrip(), text[found.start():].strip())


def _flags_as_flags(params: Iterable[Any]) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


# Options that may stand alone (their value left out), and what they mean then.
BARE = {"--causal": Causal.upper_left.value, "--sinks": "random", "--qk-norm": QkNormPlace.head.value}


BARE_GIVEN = "attnscope.bare"  # ctx.meta: the options of BARE given without their value


def expand_bare_causal(args: list[str]) -> list[str]:
    """`--causal` and `--qk-norm` given without a value get their bare meaning (BARE)."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if _bare(args, i):
            out.append(BARE[arg])
    return out


def bare_flags(args: list[str]) -> set[str]:
    """The options of BARE given without a value (`--causal` alone, not `--causal upper-left`)."""
    return {arg for i, arg in enumerate(args) if _bare(args, i)}


def _bare(args: list[str], i: int) -> bool:
    following = args[i + 1] if i + 1 < len(args) else None
    return args[i] in BARE and (following is None or (following.startswith("-") and not _numbers(following)))


def _numbers(text: str) -> bool:
    """`-1.5` or `-1,2`: a value (--sinks takes negative logits), not the next option."""
    try:
        [float(part) for part in text.split(",")]
    except ValueError:
        return False
    return True


def not_empty(value: str | None) -> str | None:
    """An empty file name would read as the option left out (`if save:`): refused instead."""
    if value == "":
        raise typer.BadParameter("an empty file name; give a file, or leave the option out")
    return value


# Sizes: the same option means the same thing in sdpa, mha and bench; only the defaults differ per command.
Batch = Annotated[int, typer.Option("--batch", min=1, help="n_batch: sequences in the batch.")]
Nq = Annotated[int, typer.Option("--nq", min=1, help="n_Q: number of queries.")]
Nk = Annotated[int, typer.Option("--nk", min=1, help="n_K: number of keys (and values).")]
NkOrCache = Annotated[int | None, typer.Option("--nk", min=1, help="n_K: number of keys (and values).  \\[default: 50; with --cache N, N + --nq]")]
NkOrNq = Annotated[int | None, typer.Option("--nk", min=1, help="n_K: number of keys; a value other than --nq makes it cross-attention.  \\[default: --nq]")]
Dk = Annotated[int, typer.Option("--dk", min=1, help="d_K: size of each query and key.")]
Dv = Annotated[int, typer.Option("--dv", min=1, help="d_V: size of each value (free to differ from d_K).")]
DFeat = Annotated[int, typer.Option("--d-feat", min=1, help="d_feat: model width, split into --heads heads.")]
Heads = Annotated[int, typer.Option("--heads", min=1, help="n_head: number of heads; d_head = d_feat / n_head.")]
Bias = Annotated[bool, typer.Option("--bias/--no-bias", help="Bias in the four Linear layers.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed for the random inputs and weights.")]
QFile = Annotated[str | None, typer.Option("--q", metavar="FILE", help="Queries from a file (.npy .npz .safetensors .pt; FILE:NAME picks one tensor).", rich_help_panel="Inputs")]
KFile = Annotated[str | None, typer.Option("--k", metavar="FILE", help="Keys from a file (default: the queries: self-attention).", rich_help_panel="Inputs")]
VFile = Annotated[str | None, typer.Option("--v", metavar="FILE", help="Values from a file (default: the keys).", rich_help_panel="Inputs")]
CausalOpt = Annotated[Causal | None, typer.Option("--causal", help="Causal mask; bare --causal is upper-left (as is_causal=True), or lower-right.", rich_help_panel="Masks")]
MaskFile = Annotated[str | None, typer.Option("--mask", metavar="FILE", help="Mask file: boolean or 0/1 (True = may attend) or float (added to the scores).", rich_help_panel="Masks")]
Pad = Annotated[int, typer.Option("--pad", min=0, metavar="N", help="Mask the last N keys of every sequence (key padding).", rich_help_panel="Masks")]
Check = Annotated[bool, typer.Option("--check", help="Run the same inputs through PyTorch's own attention and compare; exit 1 on FAIL.", rich_help_panel="Output")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (documented in docs/json.md) instead of tables.", rich_help_panel="Output")]
Save = Annotated[str | None, typer.Option("--save", metavar="FILE", callback=not_empty, help="Write every step by name to .safetensors, .npz or .pt.", rich_help_panel="Output")]
Force = Annotated[bool, typer.Option("--force", help="Let --save, --svg and --html replace an existing file.", rich_help_panel="Output")]
ExportForce = Annotated[bool, typer.Option("--force", help="Let --svg and --html replace an existing file.", rich_help_panel="Output")]
Svg = Annotated[str | None, typer.Option("--svg", metavar="FILE", callback=not_empty, help="Also write what is shown, in colour, to FILE (.svg): standalone, nothing fetched from the network.", rich_help_panel="Output")]
Html = Annotated[str | None, typer.Option("--html", metavar="FILE", callback=not_empty, help="Also write what is shown, in colour, to FILE (.html): standalone, no script, nothing fetched.", rich_help_panel="Output")]
HtmlPage = Annotated[str | None, typer.Option("--html", metavar="FILE", callback=not_empty, help="Also write an interactive page of the run to FILE (.html): steps, heatmap, every head, exact weights on click; one file, its script and data inline, nothing fetched (docs/page.md).", rich_help_panel="Output")]
Values = Annotated[bool, typer.Option("--values", help="Show the numbers of every step (corners of large ones).", rich_help_panel="Output")]
Stats = Annotated[bool, typer.Option("--stats", help="Show min, max, mean, std and NaN/Inf counts of every step.", rich_help_panel="Output")]
HeatmapOpt = Annotated[bool, typer.Option("--heatmap", help="Draw the attention pattern of one batch element (and head), fitted to the terminal.", rich_help_panel="Output")]
HeatmapBatch = Annotated[int, typer.Option("--heatmap-batch", min=0, help="Which batch element --heatmap (and --all-heads) draws (an index, from 0).", rich_help_panel="Output")]
HeatmapHead = Annotated[int, typer.Option("--heatmap-head", min=0, help="Which head --heatmap draws (an index, from 0), where the attention has an n_head axis.", rich_help_panel="Output")]
Meta = Annotated[bool, typer.Option("--meta", help="Shapes, FLOPs and memory only, on PyTorch's meta device: nothing is allocated, any size.", rich_help_panel="Size")]
MaxMemory = Annotated[str | None, typer.Option("--max-memory", metavar="SIZE", help="Refuse runs needing more than SIZE (e.g. 8GB, 512MiB); default: what the machine has available.", rich_help_panel="Size")]
Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.", hidden=False)]

# Today's variants (docs/modern-attention.md): the same option means the same thing in every command.
Window = Annotated[int | None, typer.Option("--window", min=1, metavar="W", help="Sliding window: query i sees key j when j ≤ i and i − j < W (Mistral); implies causal.", rich_help_panel="Variants")]
Softcap = Annotated[float | None, typer.Option("--softcap", metavar="C", help="Cap the scores, C · tanh(scores / C), before the mask (Gemma 2 uses 50).", rich_help_panel="Variants")]
Alibi = Annotated[bool, typer.Option("--alibi", help="Add ALiBi's per-head bias −m_h · (i − j) to the scores (BLOOM's slopes).", rich_help_panel="Variants")]
PositionBias = Annotated[str | None, typer.Option("--position-bias", metavar="FILE", help="A float tensor added to the scores as its own step (T5's relative position bias): \\[.., n_Q, n_K], broadcast to the scores.", rich_help_panel="Variants")]
TracePositionBias = Annotated[str | None, typer.Option("--position-bias", metavar="FILE", help="Handed to your code's position-bias argument as the file holds it. A float tensor \\[.., n_Q, n_K] the reference adds to its scores (T5's relative position bias), or a relative key table \\[n_Q, n_K, d_head] whose term q_i · P\\[i, j] the reference adds to score (i, j) before the scale (Shaw et al.'s relative keys, SpeechT5's position_bias).", rich_help_panel="Variants")]
RopeOpt = Annotated[bool, typer.Option("--rope", help="Rotate Q and K with rotary position embeddings (RoPE, LLaMA's half-split form).", rich_help_panel="Variants")]
RopeBase = Annotated[float | None, typer.Option("--rope-base", metavar="B", help="RoPE's base, a config's rope_theta.  \\[default: 10000]", rich_help_panel="Variants")]
Chunk = Annotated[int | None, typer.Option("--chunk", min=1, metavar="C", help="Chunked attention: query i sees key j when j ≤ i and both lie in the same chunk of C positions, j // C = i // C (Llama 4); implies causal.", rich_help_panel="Variants")]
RopeFraction = Annotated[float | None, typer.Option("--rope-fraction", metavar="F", help="Partial rotary: only the first int(F · d) coordinates of each head turn, the rest pass (a config's partial_rotary_factor: Phi-4 mini 0.75, GPT-NeoX 0.25).  \\[default: 1]", rich_help_panel="Variants")]
RopePairing = Annotated[Pairing | None, typer.Option("--rope-pairing", help="Which coordinates RoPE turns together: half-split pairs i and i + d/2 (LLaMA's rotate_half), interleaved pairs 2i and 2i + 1 (GPT-J, Llama 4).  \\[default: half-split; trace reads it from a run of code that takes RoPE's tables]", rich_help_panel="Variants")]
TemperatureOpt = Annotated[bool, typer.Option("--temperature-tuning", help="Scale each query by log1p(floor((i + 1) / floor_scale)) · attn_scale + 1, Llama 4's temperature tuning on its NoPE layers (after RoPE where there is one).", rich_help_panel="Variants")]
FloorScale = Annotated[float | None, typer.Option("--floor-scale", metavar="N", help="Temperature tuning: positions per step of the query's factor.  \\[default: 8192, Llama 4's]", rich_help_panel="Variants")]
AttnScale = Annotated[float | None, typer.Option("--attn-scale", metavar="S", help="Temperature tuning: strength of each step.  \\[default: 0.1, Llama 4's]", rich_help_panel="Variants")]
Cache = Annotated[int, typer.Option("--cache", min=0, metavar="N", help="A decode step: K and V hold N cached positions before the new ones; causal aligns lower-right.", rich_help_panel="Variants")]
WindowSideOpt = Annotated[WindowSideChoice | None, typer.Option("--window-side", help="Which way --window looks: left (causal, Mistral's) or both: query i sees key j when |i − j| ≤ W // 2, no causal mask (ModernBERT's local attention, W = local_attention).  \\[default: left]", rich_help_panel="Variants")]
SinksOpt = Annotated[str | None, typer.Option("--sinks", metavar="[random|S|S1,S2,..]", help="Attention sinks (GPT-OSS): a logit per head joins each softmax row and is dropped after, so rows sum to less than 1. Bare or random: drawn from the seed; one number for every head, or one per head.", rich_help_panel="Variants")]
QkNormOpt = Annotated[QkNormPlace | None, typer.Option("--qk-norm", help="RMSNorm of Q and K before RoPE (trace: the module's own q and k norms, RMSNorm or LayerNorm, weights included): head (each head over its d_head, Qwen3, Gemma 3; bare --qk-norm) or proj (mha: the whole projection before the split, OLMo 2).", rich_help_panel="Variants")]
ShowMask = Annotated[bool, typer.Option("--show-mask", help="Draw the combined mask (■ may attend, · masked) above the table.", rich_help_panel="Masks")]


# --- options a command takes as one value ---------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """What anatomy, bench, diff and mask show and write, declared once: each field an option (its type says how
    Typer reads it, its default is the option's), handed to the command as one value (`grouped`)."""

    json: Json = False
    svg: Svg = None
    html: Html = None
    force: ExportForce = False
    debug: Debug = False

    @contextmanager
    def around(self, command: str, **report: Any) -> Iterator[Console]:
        """Around a command's output: its errors reported (`report`: reported's names and oom_advice), --svg and
        --html checked first and written last; the block prints to the console it is given."""
        from attnscope.cli.common import exporting
        from attnscope.cli.errors import reported

        with reported(self.debug, **report), exporting(self.svg, self.html, force=self.force, json=self.json,
                                                       title=f"attnscope {command}") as out:
            yield out


def grouped(own: Callable[..., None]) -> Callable[..., None]:
    """`own(..., name: Group, ...)`, each Group a dataclass of options (Export, bench's Race), as the function Typer
    reads: each such parameter replaced, in its place, by its group's fields as options; `own` is handed each group
    as one value."""
    kind, merged = inspect.Parameter.KEYWORD_ONLY, []
    groups: dict[str, Any] = {}  # a parameter's name -> its group's dataclass
    for parameter in inspect.signature(own, eval_str=True).parameters.values():
        if not is_dataclass(parameter.annotation):
            merged.append(parameter.replace(kind=kind))
            continue
        groups[parameter.name] = group = parameter.annotation
        types = get_type_hints(group, include_extras=True)
        merged += [inspect.Parameter(f.name, kind, default=f.default, annotation=types[f.name]) for f in fields(group)]
    return signed(own, merged, lambda given: {name: group(**{f.name: given.pop(f.name) for f in fields(group)})
                                              for name, group in groups.items()})


def signed(own: Callable[..., None], parameters: list[inspect.Parameter],
           gather: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., None]:
    """`own` as Typer reads it: `parameters` its options, in their order; called with every option by name,
    `gather` takes out those `own` does not take (popping them) and gives what it takes in their place."""

    def command(**given: Any) -> None:
        gathered = gather(given)
        own(**given, **gathered)

    command.__name__, command.__qualname__, command.__doc__ = own.__name__, own.__qualname__, own.__doc__
    command.__module__ = own.__module__
    command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return command
