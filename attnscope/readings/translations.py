"""The same mask in the words of the libraries people use, as code to paste.

Each library's convention, as its documentation states it:
- `F.scaled_dot_product_attention`: boolean `attn_mask`, True = may attend; `is_causal=True` is upper-left;
  `torch.nn.attention.bias.causal_lower_right` is lower-right.
- `torch.nn.MultiheadAttention`: boolean `attn_mask`, True = masked OUT (the opposite), and a separate
  `key_padding_mask` `[n_batch, n_K]`, True = padding.
- transformers: an additive 4-D mask `[n_batch, 1, n_Q, n_K]`, 0 where a key is seen and
  `torch.finfo(dtype).min` where it is not, added to the scores by the eager attention.
- flash-attn (2.1 on): `causal=True` is aligned bottom-right (lower-right) on the lengths it is given;
  `window_size=(W - 1, 0)` is a causal sliding window of W, `window_size=(r, r)` without `causal` a
  bidirectional one (centred on the bottom-right diagonal); padding is removed (`flash_attn_varlen_func`),
  not masked, so with causal or a window the padded queries are cut too (`_flash_padded`); no arbitrary mask
  and no chunks (transformers refuses flash attention on a chunked layer once its keys outgrow one chunk).
- FlexAttention: a `mask_mod(b, h, q_idx, kv_idx)` returning True where a key is seen, compiled into a
  block mask by `create_block_mask`.
Chunked attention (Llama 4) is transformers' `chunked_causal_mask_function(C, left_padding)` (masking_utils):
causal AND `kv_idx // C == q_idx // C`; F.scaled_dot_product_attention and nn.MultiheadAttention take it as an
explicit mask.
Every snippet is run by tests/test_maskview.py and must give the same grid: flash-attn's against a stand-in
that computes flash-attn's documented rule in plain torch (its tests' `attention_ref`).

Attention sinks (GPT-OSS; sinks.py) are not a mask, but a library must be told them: F.scaled_dot_product_attention
takes them as one more key of zeros whose score is its float attn_mask column (value 0); transformers' GPT-OSS
attention as its `sinks` parameter, handed to every attention function as `s_aux`; FlexAttention by
renormalizing its output with the log-sum-exp it returns (what transformers' flex integration does).
nn.MultiheadAttention cannot (its `add_zero_attn` is a sink fixed at logit 0), nor can flash-attn 2's
`flash_attn_func` (no sink argument; transformers reaches FA3's `s_aux` through kernels-community's
vllm-flash-attn3). sink_translations.py writes them on top of this module's snippets (maskview.py joins the
two); tests/test_sinks.py runs the sink snippets against sdpa's own sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.spec import AttentionSpec

SDPA = "F.scaled_dot_product_attention"
MHA = "nn.MultiheadAttention"
HF = "transformers"
FLASH = "flash-attn"
FLEX = "FlexAttention"
CALL = "out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)"
FLEX_WIDTH = 76  # mask_mod's return line, longest on one line (the view indents it by 2)


def _terms(n_Q: int, n_K: int, offset: int, spec: AttentionSpec, pad: int,
           user: str | None) -> list[tuple[str, str]]:
    """(expression, what it is) for each boolean part, True = may attend; `ones` is an [n_Q, n_K] of True.
    A bidirectional window (`window_side` both) is |i - j| <= window // 2, with no causal part."""
    align = "lower-right" if offset else "upper-left"
    window, chunk = spec.window, spec.chunk
    terms = []
    if spec.bidirectional_window and window is not None:
        terms.append((f"ones.tril(diagonal={window // 2}) & ones.triu(diagonal={-(window // 2)})",
                      f"|i - j| <= {window // 2}"))
        window = None
    if spec.align is not None:
        terms.append((f"ones.tril(diagonal={offset})", f"causal, {align}"))
    if window is not None:
        terms.append((f"~ones.tril(diagonal={offset - window})", f"window of {window}"))
    if chunk is not None:  # a setup line first: the queries' chunks (kept short enough to read at 80 columns)
        position = f"(torch.arange({n_Q}) + {offset})" if offset else f"torch.arange({n_Q})"
        setup = f"q_chunk = {position}.unsqueeze(-1) // {chunk}  # each query's chunk\n"
        terms.append((f"{setup}(q_chunk == torch.arange({n_K}) // {chunk})", f"same chunk of {chunk}"))
    if pad:
        padding = f"the last {counted(pad, 'key')} {'is' if pad == 1 else 'are'} padding"
        terms.append((f"(torch.arange({n_K}) < {n_K - pad})", padding))
    if user == "bool":
        terms.append((f"user_mask.bool().expand({n_Q}, {n_K})", "your mask"))
    if terms and "ones" not in terms[0][0] and "expand" not in terms[0][0]:  # PyTorch wants a 2-D mask
        terms[0] = (f"{terms[0][0]}.expand({n_Q}, {n_K})", terms[0][1])
    return terms


def build(n_Q: int, n_K: int, terms: list[tuple[str, str]]) -> list[str]:
    """`allowed = first`, then `allowed = allowed & next`, one part a line, each with its comment (after the
    lines a part needs first, which its expression carries before a newline)."""
    lines = [f"ones = torch.ones({n_Q}, {n_K}, dtype=torch.bool)"] if any("ones" in t for t, _ in terms) else []
    for i, (text, what) in enumerate(terms):
        *setup, expression = text.split("\n")
        lines += setup
        lines.append(f"allowed = {expression if i == 0 else 'allowed & ' + expression}  # {what}")
    return lines


def translate(n_Q: int, n_K: int, spec: AttentionSpec, pad: int, user: str | None) -> dict[str, str]:
    """`user`: None, "bool" (a boolean or 0/1 mask file, called `user_mask`) or "float" (an additive one).
    The mask only: sink_translations.with_sinks says the sinks on top of it."""
    align, window, offset = spec.align, spec.window, spec.offset(n_Q, n_K)
    terms = mask_terms(n_Q, n_K, spec, pad, user)
    return {SDPA: _sdpa(n_Q, n_K, align, window is None and spec.chunk is None, pad, user, terms),
            MHA: _mha(n_Q, n_K, pad, user, _terms(n_Q, n_K, offset, spec, 0, user)),
            HF: _transformers(n_Q, n_K, user, terms, spec.chunk),
            FLASH: _flash(n_Q, n_K, offset, spec, pad, user),
            FLEX: _flex(n_Q, n_K, offset, spec, pad, user)}


def mask_terms(n_Q: int, n_K: int, spec: AttentionSpec, pad: int, user: str | None) -> list[tuple[str, str]]:
    """The boolean parts of the mask, padding included, as `build` writes them (sink_translations.py too)."""
    return _terms(n_Q, n_K, spec.offset(n_Q, n_K), spec, pad, user)


def _sdpa(n_Q: int, n_K: int, align: str | None, plain: bool, pad: int, user: str | None,
          terms: list[tuple[str, str]]) -> str:
    """`plain`: causal with no window or chunk, which F.scaled_dot_product_attention says without a mask."""
    only_causal = plain and not pad and user is None
    if only_causal and align == "upper-left":
        return "out = F.scaled_dot_product_attention(q, k, v, is_causal=True)"
    if only_causal and align == "lower-right":
        return ("from torch.nn.attention.bias import causal_lower_right\n"
                f"attn_mask = causal_lower_right({n_Q}, {n_K})\n{CALL}")
    lines = ["# boolean attn_mask: True = may attend", *build(n_Q, n_K, terms)]
    if user == "float":
        mask = "user_mask" if not terms else "user_mask.masked_fill(~allowed, float('-inf'))"
        return "\n".join([*lines, f"attn_mask = {mask}  # float: added", CALL])
    if not terms:
        return "out = F.scaled_dot_product_attention(q, k, v)"
    return "\n".join([*lines, "attn_mask = allowed", CALL])


def _mha(n_Q: int, n_K: int, pad: int, user: str | None, terms: list[tuple[str, str]]) -> str:
    """attn_mask without the padding (True = masked OUT), padding as key_padding_mask."""
    lines = ["# attn_mask: True = masked OUT; key_padding_mask [n_batch, n_K]: True = pad",
             *build(n_Q, n_K, terms)]
    call = ["q, k, v"]
    if user == "float":
        mask = "user_mask" if not terms else "user_mask.masked_fill(~allowed, float('-inf'))"
        lines.append(f"attn_mask = {mask}  # float: added")
        call.append("attn_mask=attn_mask")
    elif terms:
        lines.append("attn_mask = ~allowed")
        call.append("attn_mask=attn_mask")
    if pad:
        lines.append("n_batch = q.shape[0] if mha.batch_first else q.shape[1]")
        lines.append(f"padding = (torch.arange({n_K}) >= {n_K - pad}).expand(n_batch, {n_K})")
        call.append("key_padding_mask=padding")
    lines.append(f"out, weights = mha({', '.join(call)})")
    return "\n".join(lines)


def _transformers(n_Q: int, n_K: int, user: str | None, terms: list[tuple[str, str]], chunk: int | None) -> str:
    base = f"torch.zeros(n_batch, 1, {n_Q}, {n_K})" if user != "float" else "user_mask.expand(n_batch, 1, -1, -1)"
    lines = ["# additive [n_batch, 1, n_Q, n_K]: 0 = seen, finfo.min = masked; eager adds it",
             "n_batch = q.shape[0]  # q: [n_batch, n_head, n_Q, d_head], as eager's query"]
    if chunk is not None:
        lines.append(f"# the chunks are masking_utils.chunked_causal_mask_function({chunk}, left_padding)'s")
    lines += build(n_Q, n_K, terms)
    if not terms:
        return "\n".join([*lines, f"mask = {base}"])
    lines += ["low = torch.finfo(torch.float32).min", f"mask = {base}.masked_fill(~allowed, low)"]
    return "\n".join(lines)


def _flash(n_Q: int, n_K: int, offset: int, spec: AttentionSpec, pad: int, user: str | None) -> str:
    align, window, chunk, both = spec.align, spec.window, spec.chunk, spec.bidirectional_window
    if user is not None:
        return ("not expressible: flash-attn takes no arbitrary mask "
                "(use F.scaled_dot_product_attention or FlexAttention)")
    notes = ""
    if chunk is not None and max(n_K, offset + n_Q) > chunk:
        return (f"not expressible: flash-attn has no chunked attention,\nand these {max(n_K, offset + n_Q)} "
                f"positions span more than one chunk of {chunk}\n(use FlexAttention or F.scaled_dot_product_attention)")
    if chunk is not None:
        notes = f"\n# all positions lie in the first chunk of {chunk}: chunks are plain causal here"
    args = ["q, k, v"]
    if both and n_Q != n_K:
        return ("not expressible: flash-attn centres window_size on the bottom-right diagonal;\n"
                f"this bidirectional window is centred on query i itself, and n_Q = {n_Q} != n_K = {n_K}")
    head = "# q, k, v: [n_batch, n, n_head, d_head]; causal=True is lower-right\n"
    if both and window is not None and pad:
        return head + _flash_padded_both(n_Q, n_K, window // 2, pad) + notes
    if both and window is not None:
        args.append(f"window_size=({window // 2}, {window // 2})")
        window = None
    if align == "upper-left" and n_Q != n_K:
        return ("not expressible with causal=True, which flash-attn aligns lower-right (bottom-right) since 2.1; "
                f"this mask is upper-left with n_Q = {n_Q} != n_K = {n_K}")
    if window is not None:
        args += ["causal=True", f"window_size=({window - 1}, 0)"]
    elif align:
        args.append("causal=True")
    if not pad:
        return f"{head}out = flash_attn_func({', '.join(args)})" + notes
    n_kept = n_K - pad
    if len(args) == 1:  # padding alone: the keys are cut, every query stays
        cut = f"the last {counted(pad, 'key')} {'is' if pad == 1 else 'are'} cut"
        return (f"{head}# padding: {cut}, not masked (sequences of different\n"
                f"# lengths: flash_attn_varlen_func with cu_seqlens_k)\n"
                f"out = flash_attn_func(q, k[:, :{n_kept}], v[:, :{n_kept}])" + notes)
    return head + _flash_padded(n_Q, n_K, window, pad, args[1:]) + notes


def _flash_padded(n_Q: int, n_K: int, window: int | None, pad: int, args: list[str]) -> str:
    """Causal or a window, with padding. flash-attn aligns bottom-right on the lengths it is given: the unpadded
    ones (its README; its tests' `construct_local_mask` takes `sk = key_padding_mask.sum`). Cutting the padded
    keys alone would move every query's diagonal by `pad`; cutting the last `pad` queries too keeps queries
    0 .. n_Q-pad-1 in step. The rest of the grid's rows reach past the padding: they see the last unpadded keys
    (all of them under plain causal, the window's share of them under a window), computed by a second call
    whose window says so, and rows that see no key get zeros, as flash-attn gives them."""
    kept = n_Q - pad  # queries whose diagonal stays in step when the last `pad` queries are cut too
    first, last = max(kept, 0), n_Q - 1 if window is None else min(n_Q - 1, kept + window - 2)
    parts = []  # (name, what it is, code)
    if kept > 0:
        parts.append(("in_step", f"{_queries(0, kept - 1)}: in step on the unpadded lengths",
                      f"flash_attn_func(q[:, :{kept}], keys, values, {', '.join(args)})"))
    if last >= first:
        n_rows = last - first + 1
        reach = "" if window is None else f", window_size=({kept - first - n_rows + window - 1}, {n_rows - 1})"
        what = "every key before the padding" if window is None else "the window's share of the last keys"
        parts.append(("past_pad", f"{_queries(first, last)}: {what}",
                      f"flash_attn_func(q[:, {first}:{last + 1}], keys, values{reach})"))
    if last + 1 <= n_Q - 1:
        parts.append(("no_key", f"{_queries(last + 1, n_Q - 1)}: no key left",
                      f"v.new_zeros(v.shape[0], {n_Q - 1 - last}, *v.shape[2:])"))
    keys, queries = ("key", "query is") if pad == 1 else ("keys", "queries are")
    lines = [f"# flash-attn aligns causal on the lengths it is given: cutting the {pad} padded",
             f"# {keys} alone would move the diagonal by {pad}, so the last {pad} {queries} cut",
             "# too (varlen: cu_seqlens_q/k of the unpadded lengths) and computed apart",
             f"keys, values = k[:, :{n_K - pad}], v[:, :{n_K - pad}]  # the unpadded keys"]
    if len(parts) == 1:
        return "\n".join([*lines, f"# {parts[0][1]}", f"out = {parts[0][2]}"])
    for name, what, code in parts:
        lines += [f"# {what}", f"{name} = {code}"]
    return "\n".join([*lines, f"out = torch.cat([{', '.join(name for name, _, _ in parts)}], dim=1)"])


def _flash_padded_both(n: int, n_K: int, r: int, pad: int) -> str:
    """A bidirectional window |i - j| <= r with the last `pad` keys padded (n_Q = n_K = n). flash-attn centres
    window_size=(left, right) on the bottom-right diagonal of the lengths it is given (row i sees
    [i + sk - sq - left, i + sk - sq + right], a negative side meaning no bound), so once the padded keys are cut
    the window is made lopsided to stay on query i; queries past the last key's reach see no key (zeros)."""
    kept = n_K - pad  # the unpadded keys
    reach = min(n, kept + r)  # queries 0 .. reach-1 see at least one unpadded key
    lines = ["# flash-attn centres window_size on the bottom-right diagonal of the",
             f"# lengths it is given: with the {pad} padded keys cut, the window is",
             "# shifted to stay on query i",
             f"keys, values = k[:, :{kept}], v[:, :{kept}]  # the unpadded keys"]
    if reach <= 0:
        return "\n".join([*lines, "out = torch.zeros_like(q[..., :v.shape[-1]])  # no query sees a key"])
    call = f"flash_attn_func(q[:, :{reach}], keys, values, window_size=({r + kept - reach}, {r - kept + reach}))"
    if reach == n:
        return "\n".join([*lines, f"out = {call}"])
    return "\n".join([*lines, f"# {_queries(0, reach - 1)}: the window's share of the unpadded keys",
                      f"seen = {call}", f"# {_queries(reach, n - 1)}: no key left",
                      f"none = v.new_zeros(v.shape[0], {n - reach}, *v.shape[2:])",
                      "out = torch.cat([seen, none], dim=1)"])


def _queries(lo: int, hi: int) -> str:
    return f"query {lo}" if lo == hi else f"queries {lo}-{hi}"


def _flex(n_Q: int, n_K: int, offset: int, spec: AttentionSpec, pad: int, user: str | None) -> str:
    position = "q_idx" if offset == 0 else f"(q_idx + {offset})"
    window, chunk = spec.window, spec.chunk
    terms = []
    if spec.bidirectional_window and window is not None:
        terms.append(f"(abs(q_idx - kv_idx) <= {window // 2})")
        window = None
    if spec.align is not None:
        terms.append(f"(kv_idx <= {position})")
    if window is not None:
        terms.append(f"({position} - kv_idx < {window})")
    if chunk is not None:
        terms.append(f"(kv_idx // {chunk} == {position} // {chunk})")
    if pad:
        terms.append(f"(kv_idx < {n_K - pad})")
    if user == "bool":
        terms.append("user_mask.bool()[q_idx, kv_idx]")
    body = [f"    return {' & '.join(terms) if terms else 'q_idx >= 0  # every key'}"]
    if len(body[0]) > FLEX_WIDTH:  # one term a line, as build writes them, so it still reads at 80 columns
        body = [f"    allowed = {terms[0]}", *(f"    allowed = allowed & {term}" for term in terms[1:-1]),
                f"    return allowed & {terms[-1]}"]
    lines = ["def mask_mod(b, h, q_idx, kv_idx):", *body,
             f"block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN={n_Q}, KV_LEN={n_K})"]
    if user == "float":
        lines += ["def score_mod(score, b, h, q_idx, kv_idx):", "    return score + user_mask[q_idx, kv_idx]",
                  "out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)"]
    else:
        lines.append("out = flex_attention(q, k, v, block_mask=block_mask)")
    return "\n".join(lines)
