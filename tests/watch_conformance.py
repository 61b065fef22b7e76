"""The conformance matrix's watch column (attnscope.watch, issue 42; tests/test_conformance.py's test_watch_cell):
each row's tiny model watched on SDPA where its class has it (eager where not), every attention layer's pattern
within 1e-5 of the same weights' eager output_attentions, and a decoder's generate: each step's row against
transformers' own generate(output_attentions=True), its tokens the same, the outputs bit-identical to an unwatched
run. What the column says for a row is `conformance.watch_column`."""

from __future__ import annotations

import torch
from conformance import attention_layers, watch_column
from tiny_models import SENTENCE

from attnscope import watch

ATOL = 1e-5
PROMPT = "The cat sat on"
NEW_TOKENS = 3


def _fast(model) -> str:
    """The model on SDPA where transformers lets it switch (the backend a user holds), else as it is."""
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, NotImplementedError, AttributeError):
        pass
    return model.config._attn_implementation


def _inputs(family: str, folder, eager) -> dict:
    if family.startswith("vision:"):
        from PIL import Image
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
        with Image.open(folder / "picture.png") as picture:
            return {"pixel_values": processor(images=picture.convert("RGB"), return_tensors="pt")["pixel_values"]}
    if family.startswith("vlm:"):
        from tiny_vlm import TEXT, reference_inputs

        return reference_inputs(eager, folder, TEXT, folder / "picture.png")
    from attnscope.models import tokenizer

    return {"input_ids": torch.tensor([tokenizer.encode(folder, SENTENCE).ids])}


def _close(mine, theirs, what: str) -> None:
    torch.testing.assert_close(mine, theirs.float(), atol=ATOL, rtol=0, msg=what)


def cell(family: str, folder, eager, encoder_decoder: str | None, decodes: bool) -> None:
    column = watch_column(family)
    if encoder_decoder is not None:
        from tiny_encdec import source_and_target

        inputs = source_and_target(encoder_decoder, folder, eager)
    else:
        inputs = _inputs(family, folder, eager)
    impl = eager.config._attn_implementation if column == "own" else _fast(eager)
    try:
        with torch.no_grad():
            plain = eager(**inputs)
            with watch(eager) as seen:
                watched = eager(**inputs)
        first = next(k for k in ("logits", "last_hidden_state") if getattr(plain, k, None) is not None)
        assert torch.equal(getattr(plain, first), getattr(watched, first)), f"{family}: outputs changed ({impl})"
        assert eager.config._attn_implementation == impl
    finally:
        eager.set_attn_implementation("eager") if impl != "eager" else None
    with torch.no_grad():
        out = eager(**inputs, output_attentions=True)
    if column == "own":
        assert any("its own code" in note for note in seen.all_notes())
    if encoder_decoder is not None:  # every attention module in module order (encoder's, decoder's self and cross)
        assert any("numbered in module order" in note for note in seen.all_notes())
        stacks = {"encoder": list(out.encoder_attentions), "decoder": list(out.decoder_attentions),
                  "cross": list(out.cross_attentions)}
        theirs = [stacks[_kind(seen.paths[layer])].pop(0) for layer in seen.layers]
        assert not any(stacks.values()), f"{family}: not every attention watched"
    else:
        theirs = out.attentions
        every = len(theirs) == eager.config.get_text_config().num_hidden_layers
        kept = attention_layers(eager) if not family.startswith("vision:") else list(range(len(theirs)))
        theirs = [a for i, a in enumerate(theirs) if a is not None and (not every or i in kept)]
        assert seen.layers == kept, f"{family}: watched {seen.layers}, attention layers {kept}"
    for layer, pattern in zip(seen.layers, theirs, strict=True):
        _close(seen.patterns(layer), pattern[0], f"{family} watch layer {layer}")
    assert all(c.passed for c in seen.check()), family
    if decodes and encoder_decoder is not None:
        _generate_encoder_decoder(family, eager, inputs)
    elif decodes:
        _generate(family, folder, eager, column)


def _kind(path: str) -> str:
    """An encoder-decoder's module by its path: T5's EncDecAttention, BART's and Whisper's encoder_attn."""
    if "EncDecAttention" in path or "encoder_attn" in path:
        return "cross"
    return "decoder" if "decoder" in path else "encoder"


def _generate(family: str, folder, eager, column: str) -> None:
    """generate, watched on SDPA, against eager generate(output_attentions=True): the prompt's rows and each
    step's row over the keys its cache held."""
    from attnscope.models import tokenizer

    ids = torch.tensor([tokenizer.encode(folder, PROMPT).ids])
    n = ids.shape[1]
    layers = attention_layers(eager)
    impl = eager.config._attn_implementation if column == "own" else _fast(eager)
    try:
        with torch.no_grad(), watch(eager) as seen:
            sequences = eager.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        eager.set_attn_implementation("eager") if impl != "eager" else None
    with torch.no_grad():
        out = eager.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(sequences, out.sequences), f"{family}: other tokens watched on {impl}"
    for index, layer in enumerate(layers):
        mine = seen.patterns(layer)  # [n_head, n + NEW_TOKENS - 1 - offset, n + NEW_TOKENS - 1]
        offset = seen.offset(layer)  # a layer that computed only its prompt's last queries (Gemma 4's shared KV)
        for t, entries in enumerate(out.attentions):
            every = len(entries) == eager.config.get_text_config().num_hidden_layers
            theirs = entries[layer if every else index][0]  # [n_head, n_Q, keys the cache holds]
            if t == 0:
                _close(mine[:, :n - offset, :n], theirs[:, offset:], f"{family} generate layer {layer} prompt")
                continue
            row = n + t - 1 - offset
            held = theirs.shape[-1]
            key = row + offset  # the step's query's position: its keys end there
            _close(mine[:, row, key + 1 - held:key + 1], theirs[:, -1], f"{family} generate layer {layer} step {t}")


def _generate_encoder_decoder(family: str, eager, inputs: dict) -> None:
    """An encoder-decoder's generate, watched on SDPA, against the same generate on eager with output_attentions:
    the encoder's layers, each decoder self-attention layer's prompt rows and each step's row over the keys its
    cache held, and each cross-attention layer's rows, a step's one row over the same source keys. The tokens are
    the same and the sequences bit-identical to an unwatched generate (forced_eos_token_id off: BART's config
    forces </s> at the last step; a cache of the test's own: generate's would size itself by the encoder's
    num_layers, not T5's 3 decoder layers)."""
    from transformers import DynamicCache, EncoderDecoderCache

    def run(**more):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.no_grad():
            return eager.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                  forced_eos_token_id=None, cache=cache, **more)

    impl = _fast(eager)
    try:
        plain = run()
        with watch(eager) as seen:
            sequences = run()
    finally:
        eager.set_attn_implementation("eager") if impl != "eager" else None
    assert torch.equal(plain, sequences), f"{family}: the watched generate's sequences changed ({impl})"
    out = run(output_attentions=True, return_dict_in_generate=True)
    # Whisper's generate hands back only the new tokens where it returns no dict
    assert torch.equal(sequences[:, -NEW_TOKENS:], out.sequences[:, -NEW_TOKENS:]), f"{family}: other tokens ({impl})"
    n = inputs["decoder_input_ids"].shape[1]
    kinds: dict[str, list[int]] = {"encoder": [], "decoder": [], "cross": []}
    for layer in seen.layers:
        kinds[_kind(seen.paths[layer])].append(layer)
    assert len(kinds["encoder"]) == len(out.encoder_attentions), family
    for layer, theirs in zip(kinds["encoder"], out.encoder_attentions, strict=True):
        _close(seen.patterns(layer), theirs[0], f"{family} generate encoder layer {layer}")
    for kind, stack in (("decoder", out.decoder_attentions), ("cross", out.cross_attentions)):
        assert len(kinds[kind]) == len(stack[0]), f"{family}: {kind} layers {kinds[kind]}"
        for index, layer in enumerate(kinds[kind]):
            mine = seen.patterns(layer)  # decoder: [n_head, n + NEW - 1, n + NEW - 1]; cross: [.., n + NEW - 1, n_src]
            assert mine.shape[1] == n + NEW_TOKENS - 1, f"{family} {kind} layer {layer}: {tuple(mine.shape)}"
            for t, entries in enumerate(stack):
                theirs = entries[index][0]  # [n_head, n_Q, n_K]: the prompt's rows, then one row a step
                rows = slice(0, n) if t == 0 else slice(n + t - 1, n + t)
                keys = theirs.shape[-1] if kind == "cross" else rows.stop
                assert kind != "cross" or keys == mine.shape[-1], f"{family} cross layer {layer}: other source keys"
                _close(mine[:, rows, :keys], theirs, f"{family} generate {kind} layer {layer} step {t}")
                if kind == "decoder":  # nothing beyond the keys the step's cache held
                    assert float(mine[:, rows, keys:].abs().sum()) == 0.0, f"{family} {layer} step {t}"
