"""RoPE's tables in the form the code runs on, read from the op it raised on with trace's first ones (tables of the
whole head, `[n_batch, n_Q, d_head]` for a pair in one parameter). The tensor the code multiplies them with says
the rest: its last axis is the width it turns by, its positions' axis where the tables' positions go.

- Half the head, the tables broadcast over each half (GPT-OSS's `_apply_rotary_emb`: `first_half * cos -
  second_half * sin`; nanochat's `x1 * cos + x2 * sin`): one angle a pair, the frequencies over the whole head, as
  freqs_cis holds them (feeds.TableForm.pairs). The code pairs its coordinates as it will, and that pairing is read
  from its rotated tensors;
- a share of the head, the rest passed through (StableLM's `q[..., :rotary_ndims] * cos`): a rotary fraction, tables
  laid out for a pairing over that share;
- tables the code slices before it turns (DeepSeek-V3's `apply_rotary_pos_emb_interleave`: `cos[..., :d / 2]`, one
  angle a pair, on the even and odd coordinates of its d_rope-wide rotary part): as wide as make the slice meet what
  it turns (d_rope, where the tables trace gave first were d_head wide).
Where half the head could be either, both are made, and the one under which the code lines up further is kept
(runs/trace.py). Tables that broadcast only along the code's own axes (nanochat's [1, T, 1, d_head / 2] for q
[n_batch, T, n_head, d_head]) are laid so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.usertrace.feeds import TableForm
from attnscope.usertrace.rotations import MATRICES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Failure


def forms(failure: Failure, width: int | None, d_head: int, n_Q: int) -> list[TableForm]:
    """The forms to try, likeliest first, where the code raised on tables `width` (or d_head) wide: from the shapes
    that met in the op it raised on, the other operand's last axis (an even share of the head, or the head) and its
    positions' axis (of size n_Q)."""
    given = width or d_head
    if len(failure.shapes) != 2 or not all(failure.shapes):
        return []
    a, b = failure.shapes
    # the tensor the code turns: the one of more axes, else the one whose width is not the tables'
    other = a if len(a) > len(b) else b if len(b) > len(a) else (a if a[-1] != given else b)
    turned = other[-1]
    if turned < 2 or turned % 2 or turned > d_head:
        return []
    kinds = []
    sliced = _sliced(failure, given, d_head)
    if sliced is not None:
        kinds.append(TableForm(sliced))
    if 2 * turned == d_head:
        kinds.append(TableForm(turned, pairs=True))
    if turned < given:
        kinds.append(TableForm(turned))
    if turned == d_head and given != d_head:
        kinds.append(TableForm(turned))
    at = next((i for i, size in enumerate(other[:-1]) if size == n_Q), None)
    laid = [TableForm(k.width, k.pairs, (len(other), at)) for k in kinds] if at is not None and len(other) > 2 else []
    if at is not None and len(other) > 2 and turned == given:  # as wide as they were, along other axes
        laid.insert(0, TableForm(turned, axes=(len(other), at)))
    return kinds + laid


def _met(failure: Failure, given: int) -> tuple[int, int] | None:
    """(the tables' width as the op met them, the width of what it turns there); None where not two shapes met."""
    if len(failure.shapes) != 2 or not all(failure.shapes):
        return None
    a, b = failure.shapes
    other = a if len(a) > len(b) else b if len(b) > len(a) else (a if a[-1] != given else b)
    return (b if other is a else a)[-1], other[-1]


def _sliced(failure: Failure, given: int, d_head: int) -> int | None:
    """Where the code keeps a share of the tables it is handed (DeepSeek-V3's `cos[..., : cos.shape[-1] // 2]`, one
    angle a pair for the even and odd coordinates it turns): the width that makes the share meet what it turns,
    that share's inverse wider; None where the tables met the op as wide as they were given."""
    met = _met(failure, given)
    if met is None or not 0 < met[0] < given or given % met[0]:
        return None
    width = met[1] * (given // met[0])
    return width if width <= d_head and width % 2 == 0 else None


def narrower(failure: Failure, form: TableForm) -> TableForm | None:
    """`form` of a whole table (a complex one, Meta's freqs_cis) as narrow as what the code turns with it, where it
    raised so: DeepSeek-V2's q_pe of d_rope / 2 complex numbers against a table of d_head / 2, its rotary part being
    no share of the head trace read. None where the op met no narrower tensor."""
    met = _met(failure, form.width)
    if not form.holds or met is None or met[0] != form.width or not 0 < met[1] < form.width:
        return None
    return TableForm(met[1], form.pairs, form.axes, form.holds, form.layout, form.swapped)


def holders(failure: Failure, tables: list[str], width: int | None, d_head: int,
            given: TableForm | None = None, read: tuple[str, ...] = ()) -> list[TableForm]:
    """The other forms of RoPE's whole table, where one parameter takes it (feeds.WHOLE_TABLES) and the code raised
    on the form trace gave it first (`given`, else the one its name says), or a parameter `read` as the table by its
    use (paramuse.turns): a complex table, one a sequence, one as real numbers (gpt-fast's), the pair (cos, sin), or 2x2
    rotation matrices (MATRICES).
    Which one it runs on is read from its run on each (runs/trace_attempt.py): the op it raised on says what it does
    with the value (`.to(..)`, `.real`, an index of three axes, `cos, sin = ..`), not its name."""
    from attnscope.usertrace.feeds import WHOLE_TABLES
    from attnscope.usertrace.load import table_kind

    whole = [t for t in tables if table_kind(t) in WHOLE_TABLES or t in read]
    if len(whole) != 1 or len(tables) != 1 or d_head % 2:
        return []
    fed = given.holds if given is not None and given.holds else \
        "complex" if table_kind(whole[0]) == "freqs_cis" else "cos, sin"
    made = {k: TableForm(width or d_head, holds=k) if k.startswith("cos, sin") else
            TableForm(d_head // 2, pairs=True, holds=k) for k in HELD}
    # a value used as a tensor (`'tuple' object has no attribute`) is tried as one first
    order = [*MATRICES, "complex, batched", "complex", "real", "cos, sin", "cos, sin, shared"] \
        if "tuple" in failure.message else \
        ["cos, sin", "cos, sin, shared", "complex, batched", "complex", "real", *MATRICES]
    return [made[k] for k in order if k != fed]


HELD = {"complex": "a complex table e^(i·position·inv_freq), [n_Q, d_head / 2] (Meta's freqs_cis)",
        "complex, batched": "a complex table e^(i·position·inv_freq) for each sequence, [n_batch, n_Q, d_head / 2] "
                            "(Llama 4's freqs_cis)",
        "real": "a complex table e^(i·position·inv_freq) as real numbers, its cos and sin on a last axis of 2, "
                "[n_Q, d_head / 2, 2] (gpt-fast's freqs_cis, torch.view_as_real's form)",
        "cos, sin": "the pair (cos, sin), each [n_batch, n_Q, d_head] (transformers' position_embeddings)",
        "cos, sin, shared": "the pair (cos, sin), each [n_Q, d_head], one for all sequences (transformers' Pixtral "
                            "and vision towers, unsqueezed at 0)",
        **{k: f"2x2 rotation matrices [[cos, -sin], [sin, cos]] for each pair, [{', '.join(dims)}]"
           + (" (Flux's pe)" if k == "matrices" else "") for k, dims in MATRICES.items()}}


def note(form: TableForm, failure: Failure, given: int, d_head: int, parameters: list[str]) -> str:
    """What was read: the tables the code runs on, and from what."""
    where = f" (line {failure.line})" if failure.line else ""
    if form.holds:
        pairing = "; its pairing is read from its rotated tensors" if form.pairs else ""
        said = f"line {failure.line}: {failure.message}" if failure.line else failure.message
        share = f", {form.width} angles for the first {2 * form.width} of each head's {d_head} coordinates" \
            if form.pairs and 2 * form.width < d_head else ""
        return (f"RoPE's table ({', '.join(parameters)}): your code runs on {HELD[form.holds]}{share}, read from its "
                f"run: it raised on the form trace gave it first ({said}) and runs on this one{pairing}")
    laid = ""
    if form.axes is not None:
        dims = ["1"] * form.axes[0]
        dims[form.axes[1]], dims[-1] = "n_Q", str(form.width)
        laid = f", laid [{', '.join(dims)}] as the tensor it turns"
    names = ", ".join(parameters)
    if form.pairs:
        return (f"RoPE's tables ({names}): your code broadcasts them over each half of the head, so they hold one "
                f"angle a pair, {form.width} = d_head / 2 wide with the frequencies over the whole head (as freqs_cis "
                f"holds them: GPT-OSS's and nanochat's){laid}; read from your code, which raised on tables {given} "
                f"wide{where} and runs on these; its pairing is read from its rotated tensors")
    if form.width == _sliced(failure, given, d_head):
        seen, turned = _met(failure, given) or (0, 0)
        return (f"RoPE's tables ({names}): {form.width} wide, read from your code, which keeps a share of the tables "
                f"it is handed: it raised on tables {given} wide{where}, their share ({seen} wide) meeting what it "
                f"turns ({turned} wide), and runs on these")
    if form.width < d_head:
        return (f"RoPE: it rotates the first {form.width} of each head's {d_head} coordinates (a rotary fraction of "
                f"{form.width / d_head:g}), read from your code, which raised on tables {given} wide{where} and runs "
                f"on tables {form.width} wide{laid}; the reference rotates so")
    return (f"RoPE's tables ({names}){laid}: read from your code, which raised on the first ones{where} and runs on "
            "these")


def _raised(failure: Failure) -> str:
    return f"line {failure.line}: {failure.message}" if failure.line else failure.message


def unasked(name: str, failure: Failure) -> str:
    """The line for a parameter the code multiplies into its queries or keys as it is (RoPE's table) without --rope."""
    return (f"{name}: your code multiplies it into its queries or keys as it is, as RoPE's table, and raised on the "
            f"input trace gave it ({_raised(failure)}); add --rope (and --rope-base B, --rope-pairing P) and trace "
            "makes the table in the form your code runs on, never positions or an embedding in its place")


def unread(name: str, failure: Failure) -> str:
    """The line for RoPE's table (read by its use) in none of the forms trace knows."""
    tried = "; ".join(HELD.values())
    return (f"{name}: your code multiplies it into its queries or keys as it is, as RoPE's table, and runs on none "
            f"of the forms trace knows (it raised on the input trace gave it first: {_raised(failure)}; tried: "
            f"{tried}; and tables [n_Q, d_head] laid for a pairing); trace gives it no positions or embedding in "
            "its place")
