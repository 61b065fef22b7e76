"""Tiny random vision-language models, one per family attnscope reads the image tokens of, each saved with its
own processor (tokenizer + image processor, built offline) beside it, and a test image drawn here.

- gemma3: Gemma3ForConditionalGeneration, a SigLIP tower on 28 px (2 x 2 patches of 14), 4 image tokens per image
  (a 2 x 2 grid), layers sliding (window 4), sliding, full: the image block is bidirectional on every kind.
- llama4: Llama4ForConditionalGeneration, 56 px (4 x 4 patches), pixel shuffle 0.5: 4 <|patch|> tokens (2 x 2)
  per tile, up to 4 tiles and the global view; RoPE + chunked layers 0, 2 (chunks of 4) and NoPE layers 1, 3. Its
  processor_config.json is written as transformers 5.23's Llama4Processor.save_pretrained writes it (the image
  processor's settings nested in it): that class needs torchvision to be built, not installed here.
- llava: LlavaForConditionalGeneration over a LLaMA (GQA, biases), a CLIP tower on 28 px: 4 <image> tokens (2 x 2).
- llava_mistral: the same over a Mistral with a window of 4.
Qwen's processors need torchvision for their video half (not installed here), so their folders hold the tokenizer
and the image processor apart, as attnscope then reads them.
- qwen2_5_vl: Qwen2_5_VLForConditionalGeneration on 56 px, patches of 14 merged 2 x 2: 4 tokens, M-RoPE.
- qwen3_vl: Qwen3VLForConditionalGeneration on 64 px, patches of 16 merged 2 x 2: 4 tokens, interleaved M-RoPE,
  qk-norm, deepstack features added to the first layer.

`build(name, folder)` returns transformers' eager model loaded back from the folder: the oracle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import _bpe, _tokenizer, perturb

NAMES = ("gemma3", "llama4", "llava", "llava_mistral", "qwen2_5_vl", "qwen3_vl")
TEXT = "The cat sat on the mat."
DECODER = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "initializer_range": 0.3}


def image(path: Path, size: int = 40) -> Path:
    """A small RGB test picture with something in it: a red disc on a blue-green gradient, saved as PNG."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (size, size))
    picture.putdata([(0, 4 * x + 40, 4 * y + 40) for y in range(size) for x in range(size)])
    ImageDraw.Draw(picture).ellipse((size // 4, size // 5, 3 * size // 4, 3 * size // 4), fill=(220, 30, 30))
    picture.save(path)
    return path


def _llama_tokenizer(extra: list[str]):
    tokenizer = _tokenizer("llama")
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    return tokenizer


def _gemma3():
    import transformers as tf

    vocab, merges = _bpe(False, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>",
                                 "<end_of_image>", "<image_soft_token>"])
    tokenizer = tf.GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("boi", "<start_of_image>"), ("eoi", "<end_of_image>"), ("image", "<image_soft_token>"))}
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer), **{**DECODER, "hidden_size": 24}, head_dim=16,
                               num_hidden_layers=3, query_pre_attn_scalar=12, sliding_window=4,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             boi_token_index=ids["boi"], eoi_token_index=ids["eoi"], image_token_index=ids["image"],
                             initializer_range=0.3)
    processor = tf.Gemma3Processor(tf.Gemma3ImageProcessor(size={"height": 28, "width": 28}), tokenizer,
                                   image_seq_length=4)
    return config, tf.Gemma3ForConditionalGeneration, processor


def _llama4():
    import transformers as tf
    from tiny_llama4_smollm3_phi3 import _llama4_text

    specials = ["<|image_start|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
                "<|image_end|>"]
    tokenizer = _llama_tokenizer(specials)
    # Llama4VisionMLP2's fc1 reads the pixel-shuffled patches: intermediate_size = hidden_size / 0.5²
    vision = tf.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   image_size=56, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                                   projector_output_dim=16, pixel_shuffle_ratio=0.5, initializer_range=0.3)
    text = _llama4_text(len(tokenizer))
    config = tf.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             image_token_index=tokenizer.convert_tokens_to_ids("<|patch|>"),
                             boi_token_index=tokenizer.convert_tokens_to_ids("<|image_start|>"),
                             eoi_token_index=tokenizer.convert_tokens_to_ids("<|image_end|>"))
    return config, tf.Llama4ForConditionalGeneration, (tokenizer, _Llama4ProcessorConfig())


class _Llama4ProcessorConfig:
    """processor_config.json as Llama4Processor(Llama4ImageProcessor(size=56, max_patches=4), tokenizer,
    patch_size=14).save_pretrained writes it in transformers 5.23 (recorded where torchvision was installed)."""

    SETTINGS = {"fake_image_token": "<|image|>", "image_token": "<|image|>", "patch_size": 14,
                "processor_class": "Llama4Processor",
                "image_processor": {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
                                    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                                    "image_processor_type": "Llama4ImageProcessor", "max_patches": 4, "resample": 2,
                                    "rescale_factor": 0.00392156862745098, "resize_to_max_canvas": False,
                                    "size": {"height": 56, "width": 56}}}

    def save_pretrained(self, folder: Path) -> None:
        import json

        (folder / "processor_config.json").write_text(json.dumps(self.SETTINGS, indent=2))


def _llava(text_model: str):
    import transformers as tf

    tokenizer = _llama_tokenizer(["<image>"])
    if text_model == "llama":
        text = tf.LlamaConfig(vocab_size=len(tokenizer), **DECODER, num_hidden_layers=2, attention_bias=True)
    else:
        text = tf.MistralConfig(vocab_size=len(tokenizer), **DECODER, num_hidden_layers=2, sliding_window=4)
    vision = tf.CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=28, patch_size=14, projection_dim=16)
    config = tf.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                            image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                            vision_feature_select_strategy="default")
    images = tf.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = tf.LlavaProcessor(images, tokenizer, patch_size=14, vision_feature_select_strategy="default",
                                  num_additional_image_tokens=1)
    return config, tf.LlavaForConditionalGeneration, processor


def _qwen_tokenizer():
    tokenizer = _tokenizer("qwen2")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>",
                                                                "<|image_pad|>", "<|video_pad|>"]})
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for name, token in
           (("vision_start", "vision_start"), ("vision_end", "vision_end"), ("image", "image_pad"),
            ("video", "video_pad"))}
    return tokenizer, ids


def _qwen2_5_vl():
    import transformers as tf

    tokenizer, ids = _qwen_tokenizer()
    text = {"vocab_size": len(tokenizer), **DECODER, "num_hidden_layers": 2,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 32,
              "fullatt_block_indexes": [0]}
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    images = tf.Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56})
    return config, tf.Qwen2_5_VLForConditionalGeneration, (images, tokenizer)


def _qwen3_vl():
    import transformers as tf

    tokenizer, ids = _qwen_tokenizer()
    text = {"vocab_size": len(tokenizer), **DECODER, "num_hidden_layers": 2, "head_dim": 8,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
                                "rope_theta": 5000000.0}}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
              "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    images = tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64})
    return config, tf.Qwen3VLForConditionalGeneration, (images, tokenizer)


BUILDERS = {"gemma3": _gemma3, "llama4": _llama4, "llava": lambda: _llava("llama"),
            "llava_mistral": lambda: _llava("mistral"), "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}


def build(name: str, folder: Path):
    """Save a tiny `name` model and its processor to `folder`; return transformers' eager model read back."""
    folder.mkdir(parents=True, exist_ok=True)
    config, cls, processor = BUILDERS[name]()
    torch.manual_seed(100 + NAMES.index(name))
    model = perturb(cls(config).eval())
    model.save_pretrained(folder)
    for part in processor if isinstance(processor, tuple) else (processor,):
        part.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def eager_attentions(model, folder: Path, text: str, picture: Path) -> tuple[list[int], tuple]:
    """transformers' own processor on (text, picture) and the full VLM's eager output_attentions: the ids and every
    layer's `[1, n_head, n_tokens, n_tokens]`."""
    inputs = reference_inputs(model, folder, text, picture)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    return inputs["input_ids"][0].tolist(), out.attentions


def reference_inputs(model, folder: Path, text: str, picture: Path) -> dict:
    """transformers' own processor on (text, picture). The text gets the processor's image placeholder in front.
    Qwen's (no processor without torchvision): its image processor, and the tokens placed as Qwen2_5_VLProcessor
    does. Llama 4's (its image processor is a torchvision class): Llama4Processor over attnscope's copy of its
    steps, held equal to it bit for bit in tests/test_llama4_tiles.py."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    with Image.open(picture) as opened:
        rgb = opened.convert("RGB")
    if "llama4" in type(model).__name__.lower():
        from attnscope.models.config import read_config
        from attnscope.models.vision.vlm import place

        return place(folder, read_config(folder), text, rgb).inputs
    if "qwen" in type(model).__name__.lower():
        images = AutoImageProcessor.from_pretrained(folder, backend="pil")(images=[rgb], return_tensors="pt")
        n = int(images["image_grid_thw"].prod()) // 4  # merge_size 2: 2 x 2 patches a token
        prompt = f"<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>{text}"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        inputs = {**tokenizer(prompt, return_tensors="pt"), **images}
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    else:
        processor = AutoProcessor.from_pretrained(folder)
        placeholder = getattr(processor, "boi_token", None) or processor.image_token
        inputs = processor(text=f"{placeholder}{text}", images=[rgb], return_tensors="pt")
    return dict(inputs)


def conformance_cell(runner, app, folder: Path, eager, view: str, monkeypatch) -> None:
    """A vision-language model's cell of the conformance matrix (tests/test_conformance.py): `--text TEXT` with its
    folder's picture.png against transformers' eager VLM on the processor's inputs. short: the last layer's every
    head (--all-heads); all-layers: every layer's pattern; generate: the new ids and each step's row of the last layer
    against `generate(output_attentions=True)`; long: a page's last layer, every row in blocks (LONG_TOKENS and
    BLOCK_ROWS made small), Qwen's --rows refused in one line; check: PASS, decoding included."""
    import json

    from attnscope.models.forward import long

    image = folder / "picture.png"
    inputs = reference_inputs(eager, folder, TEXT, image)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        theirs = eager(**inputs, output_attentions=True).attentions  # [1, n_head, n_tokens, n_tokens] per layer
    base = ["head", "--model", str(folder), "--text", TEXT, "--image", str(image)]
    last = str(len(theirs) - 1)

    def payload(*more: str) -> dict:
        result = runner.invoke(app, [*base, *more, "--json"])
        assert result.exit_code == 0, result.output
        found = json.loads(result.stdout)
        assert found["token_ids"] == ids
        return found

    def close(mine, reference, what: str) -> None:
        torch.testing.assert_close(torch.tensor(mine), reference.float(), atol=1e-5, rtol=0, msg=what)

    if view == "short":  # the last layer traced (all-layers holds every layer's pattern)
        for head in payload("--layer", last, "--all-heads")["heads"]:
            close(head["attention"], theirs[int(last)][0, head["head"]], f"layer {last} head {head['head']}")
    elif view == "all-layers":
        got = payload("--layer", "0", "--all-layers")
        for entry, pattern in zip(got["all_layers"], theirs, strict=True):
            close(entry["attention"], pattern[0], f"all-layers layer {entry['layer']}")
    elif view == "generate":
        steps = payload("--layer", last, "--generate", "3")["decode_steps"]
        with torch.no_grad():
            out = eager.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
        assert [s["token_id"] for s in steps] == out.sequences[0, len(ids):].tolist()
        for t, step in enumerate(steps):
            row = out.attentions[t][int(last)][0, :, -1]  # [n_head, keys the cache holds]
            close(torch.tensor(step["attention"])[:, -row.shape[-1]:].tolist(), row, f"generate step {t}")
    elif view == "long" and "qwen" in type(eager).__name__.lower():  # transformers computes the whole pattern
        result = runner.invoke(app, [*base, "--rows", "0:4"])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "drop --rows" in result.stderr
    elif view == "long":
        monkeypatch.setattr(long, "LONG_TOKENS", 8)
        monkeypatch.setattr(long, "BLOCK_ROWS", 3)
        got = payload("--layer", last, "--head", "1", "--rows", f"0:{len(ids)}")
        close(got["rows"]["attention"], theirs[int(last)][0, 1], "long: every row of head 1 in blocks")
    else:
        got = payload("--layer", last, "--generate", "2", "--check")
        assert got["check_passed"] is True and len(got["check"]) == 4, got["check"]
