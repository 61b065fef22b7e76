"""RoPE's pair of tables (cos, sin) in the other forms a rotary module hands them in, beside those tableforms.py reads
from the op the code raised on:

- the order of the pair: transformers' `cos, sin = position_embeddings`, or GPT-J's and CodeGen's `sin, cos = ...`
  (their `_get_embed_positions` splits one sincos table, sin first);
- the layout over the share turned: half-split, `cat((freqs, freqs))` (LLaMA's), or interleaved,
  `repeat_interleave(freqs, 2)` (Cohere's), each angle on the pair the code's own rotation turns;
- half-split, turned interleaved by code that lays the tables out itself (GLM's, GLM-4's and Helium's
  `cos[..., : cos.shape[-1] // 2].repeat_interleave(2)`, then an interleaved rotate_half), over the whole head or
  the share the tables are wide (GLM's partial_rotary_factor);
- half the share, one angle a pair, that the code expands itself (GPT-J's `repeat_interleave(sin, 2, 3)` over its
  rotary_dim): feeds.TableForm.pairs, narrower than d_head / 2 where a share of each head turns.

None of these is a mistake of the code's: the module that makes the tables is not traced, so each is a convention,
tried in turn, and the one under which the code runs and its rotated queries and keys line up with the reference is
kept (runs/trace_attempt.run_plan), said in a note (`note`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from attnscope.usertrace.feeds import TableForm

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.record import Failure


# the forms a pair of tables takes: as the parameter's name says, and (cos, sin) with or without a batch axis
PAIRED = ("", "cos, sin", "cos, sin, shared")

def paired(plan: Plan) -> bool:
    """Whether one parameter takes the pair (cos, sin) in a tuple (transformers' position_embeddings): its order is
    then the module's to choose."""
    from attnscope.usertrace.load import PAIR_TABLES, table_kind

    return len(plan.tables) == 1 and table_kind(plan.tables[0]) not in ("cos", "sin", *PAIR_TABLES)


def halves(failure: Failure, d_head: int, known: list[TableForm]) -> list[TableForm]:
    """Half-width tables, one angle a pair, for each share of the head an operand of the op the code raised on is
    as wide as (GPT-J: q_rot [.., rotary_dim] met tables it had doubled): the code expands them itself."""
    widths = [s[-1] for s in failure.shapes if s]
    made = [TableForm(w // 2, pairs=True) for w in dict.fromkeys(widths) if 2 <= w < d_head and w % 2 == 0]
    return [f for f in made if f not in known]


def variants(forms: list[TableForm], plan: Plan, asked: str | None) -> list[TableForm]:
    """Each form, then, where one parameter takes the pair (its model's rotary module chose its form), in the other
    layout (where --rope-pairing, `asked`, does not fix it) and in the other order: likeliest first, the forms' own
    order kept. Tables apart (`cos`, `sin` [n_pos, d_head], LLMs-from-scratch's) keep their one layout: a rotation
    that pairs otherwise than they are laid is the code's mistake (rope.pairing). Either may be laid half-split and
    turned interleaved by code that lays them out itself (`converted`)."""
    out: list[TableForm] = []
    for form in forms:
        laid = [form]
        if not paired(plan) or form.holds not in PAIRED:  # `cos`, `sin` apart: LLMs-from-scratch's form
            out += [f for f in (form, *converted(form, asked)) if f not in out]
            continue
        # before Cohere's layout: halved by such code, interleaved tables turn two pairs alike, which a frequency table
        # read from the code (a module that says no base) could take for its own
        laid += converted(form, asked)
        if not form.pairs and asked is None:
            laid.append(TableForm(form.width, axes=form.axes, holds=form.holds, layout="interleaved"))
        laid += [dataclasses.replace(f, swapped=True) for f in laid]
        out += [f for f in laid if f not in out]
    return out


def converted(form: TableForm, asked: str | None) -> list[TableForm]:
    """`form` laid half-split, `cat((freqs, freqs))`, and turned interleaved by the code, which lays the tables out
    itself: it takes the first half of each, one angle a pair, and repeat_interleaves it (GLM's, GLM-4's and Helium's
    apply_rotary_pos_emb), over the tables' width (the share of each head it turns). The rotation it makes of them
    is read: a convention where --rope-pairing does not ask for half-split. Empty for tables of one angle a pair, or
    laid out already."""
    if form.pairs or form.layout or form.turned or form.holds not in PAIRED or asked == "half-split":
        return []
    return [TableForm(form.width, axes=form.axes, holds=form.holds, turned="interleaved")]


def note(form: TableForm, names: list[str], given: int, d_head: int, failure: Failure | None) -> str:
    """What was read: the order and layout of the pair the code runs on, and its width."""
    order = "(sin, cos), sin first" if form.swapped else "(cos, sin)"
    if form.pairs:
        laid = f"one angle a pair, {form.width} wide (your code expands them itself)"
    elif form.layout == "interleaved":
        laid = f"interleaved, repeat_interleave(freqs, 2) (Cohere's), {form.width} wide"
    elif form.turned:
        laid = (f"half-split, cat((freqs, freqs)), {form.width} wide, which your code lays out {form.turned} itself "
                "(the first half of each, repeat_interleave(2): GLM's and Helium's apply_rotary_pos_emb)")
    else:
        laid = f"half-split, cat((freqs, freqs)), {form.width} wide"
    share = 2 * form.width if form.pairs else form.width
    turned = f", over the first {share} of each head's {d_head} coordinates" if share < d_head else ""
    why = (f"it raised on tables {given} wide (line {failure.line}: {failure.message})" if failure is not None and
           failure.line else f"it raised on tables {given} wide" if failure is not None else
           "its rotated queries and keys line up with the reference under this form and not under trace's first")
    pairing = "; its pairing is read from its rotated tensors" if form.pairs else \
        f"; the reference rotates {'interleaved' if form.layout or form.turned else 'half-split'}"
    read = failure is None and not form.pairs and bool(form.layout or form.turned)  # interleaved, read off the run
    told = ("; where your model pairs half-split (LLaMA's rotate_half), --rope-pairing half-split says so and this "
            "rotation is then named a mistake (rope.pairing)") if read else ""
    return (f"RoPE's tables ({', '.join(names)}): given as {order}, {laid}{turned}, read from your code's run: {why}"
            f"{pairing}{told}")
