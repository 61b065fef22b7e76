"""Tiny random models of every family attnscope reads, built from transformers' own configs and classes and
saved with save_pretrained, each with a small BPE tokenizer of the family's own tokenizer class (trained
here on a few sentences, with the family's special tokens).

`build(family, folder)` returns transformers' eager model loaded back from the folder: the oracle.
Weights are drawn with std 0.3 (norm weights too, so Gemma's `1 + w` matters), which gives sharp,
varied attention patterns rather than the near-uniform ones of the default initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = ["The cat sat on the mat because it was tired.", "A dog ran to the park and the cat ran after it.",
          "Attention is all you need, said the mat to the dog."] * 4
SENTENCE = "The cat sat on the mat because it was tired, and the dog ran."  # longer than a window of 4

FAMILIES = ("bert", "roberta", "gpt2", "llama", "mistral", "qwen2", "gemma2")
# Families with tests of their own (tests/test_gpt_oss.py, tests/test_modernbert.py), built the same way.
MODERN = ("gpt_oss", "modernbert")


def _bpe(byte_level: bool, specials: list[str], size: int = 200) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        alphabet = sorted(set("".join(CORPUS)) | {"▁"})
    trainer = trainers.BpeTrainer(vocab_size=size + len(alphabet), special_tokens=specials, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges  # type: ignore[return-value]


def _tokenizer(family: str):
    from transformers import (
        BertTokenizer,
        GemmaTokenizer,
        GPT2Tokenizer,
        LlamaTokenizer,
        Qwen2Tokenizer,
        RobertaTokenizer,
    )

    if family in ("bert", "modernbert"):  # ModernBERT's own is a BPE with BERT's [CLS] ... [SEP]: ids differ, not roles
        words = sorted({w.strip(".,").lower() for s in CORPUS for w in s.split()} | {".", ","})
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
        return BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    if family in ("llama", "mistral"):
        vocab, merges = _bpe(False, ["<unk>", "<s>", "</s>"])
        return LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    if family == "gemma2":
        vocab, merges = _bpe(False, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
        return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    if family == "roberta":
        vocab, merges = _bpe(True, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        return RobertaTokenizer(vocab=vocab, merges=merges)
    vocab, merges = _bpe(True, ["<|endoftext|>"])
    return (GPT2Tokenizer if family in ("gpt2", "gpt_oss") else Qwen2Tokenizer)(vocab=vocab, merges=merges)


def _config_and_class(family: str, vocab: int):
    import transformers as tf

    shared = {"vocab_size": vocab, "initializer_range": 0.3}
    decoder = {**shared, "hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}
    if family == "bert":
        return tf.BertConfig(**shared, hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
                             intermediate_size=37, max_position_embeddings=64), tf.BertModel
    if family == "roberta":
        return tf.RobertaConfig(**shared, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=37, max_position_embeddings=70, pad_token_id=1,
                                type_vocab_size=1), tf.RobertaForMaskedLM
    if family == "gpt2":
        return tf.GPT2Config(**shared, n_embd=24, n_layer=3, n_head=4, n_positions=64,
                             scale_attn_by_inverse_layer_idx=True), tf.GPT2LMHeadModel
    if family == "llama":  # GQA, every bias, and Llama 3.1's RoPE scaling
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
        return tf.LlamaConfig(**decoder, num_hidden_layers=3, rope_theta=500000.0, rope_scaling=scaling,
                              attention_bias=True, mlp_bias=True), tf.LlamaForCausalLM
    if family == "mistral":  # a window of 4 on every layer; saved as the bare MistralModel (no "model." prefix)
        return tf.MistralConfig(**decoder, num_hidden_layers=2, sliding_window=4), tf.MistralModel
    if family == "qwen2":  # layer 0 full, layers 1 and 2 sliding (from max_window_layers)
        return tf.Qwen2Config(**decoder, num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                              max_window_layers=1), tf.Qwen2ForCausalLM
    if family == "gpt_oss":  # sliding, full, sliding; yarn that bites at 16 positions; a limit the SwiGLU reaches
        yarn = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16, "rope_theta": 150000.0}
        return tf.GptOssConfig(**decoder, num_hidden_layers=3, head_dim=8, sliding_window=4, num_local_experts=4,
                               num_experts_per_tok=2, rope_parameters=yarn, swiglu_limit=1.5), tf.GptOssForCausalLM
    if family == "modernbert":  # global, local, local, global; a local window of 4 (2 either side)
        return tf.ModernBertConfig(**shared, hidden_size=32, intermediate_size=20, num_hidden_layers=4,
                                   num_attention_heads=4, local_attention=4, max_position_embeddings=128,
                                   pad_token_id=0, cls_token_id=2, bos_token_id=2, sep_token_id=3,
                                   eos_token_id=3), tf.ModernBertForMaskedLM
    gemma = {**decoder, "hidden_size": 24, "head_dim": 16}  # head_dim decoupled: 4 heads x 16 on a width of 24
    return tf.Gemma2Config(**gemma, num_hidden_layers=3, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                           sliding_window=4), tf.Gemma2ForCausalLM


def build(family: str, folder: Path, *, shard: bool = False, **sizes):
    """Save a tiny `family` model and its tokenizer to `folder`; return transformers' eager model read back.
    `sizes` override the config's (e.g. num_hidden_layers=12)."""
    tokenizer = _tokenizer(family)
    config, cls = _config_and_class(family, len(tokenizer))
    return save_random(folder, tokenizer, config, cls, (*FAMILIES, *MODERN).index(family), shard=shard, **sizes)


def save_random(folder: Path, tokenizer, config, cls, seed: int, *, shard: bool = False, **sizes):
    """`cls(config)` with weights drawn with std 0.3 from `seed`, saved with its tokenizer to `folder`; transformers'
    eager model read back."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in sizes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = perturb(cls(config).eval())
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    tokenizer.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def perturb(model, keep: tuple[str, ...] = ()):
    """Every parameter, and every floating buffer the checkpoint saves (BART's final_logits_bias, DeepSeek's
    e_score_correction_bias), drawn from N(0, 0.3) but those named with a word of `keep` (sinusoids that are not
    learned): a trained-looking model, with no norm weight of 1 and no zero bias, sink or table to hide a bug."""
    saved = set(model.state_dict())
    buffers = [(name, buffer) for name, buffer in model.named_buffers() if name in saved]
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *buffers]:
            if tensor.is_floating_point() and not any(word in name for word in keep):
                tensor.normal_(0.0, 0.3)
    return model


def eager_run(model, folder: Path, modules: list) -> tuple[list[int], tuple, dict[int, torch.Tensor]]:
    """transformers' eager run on SENTENCE: the ids, `output_attentions`, and the output of each of `modules` (the
    attention modules, layer by layer: what attnscope calls `x`)."""
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    outputs: dict[int, torch.Tensor] = {}
    hooks = [module.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, module in enumerate(modules)]
    with torch.no_grad():
        attentions = model(**encoded, output_attentions=True).attentions
    for hook in hooks:
        hook.remove()
    return encoded["input_ids"][0].tolist(), attentions, outputs


def with_config(folder: Path, target: Path, change, name: str = "config.json") -> Path:
    """A copy of a saved model in `target` whose config.json (or the JSON file `name`) is `change(config)` (a
    dict in, a dict out)."""
    import shutil

    shutil.copytree(folder, target)
    path = target / name
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return target


def refuses_config(runner, folder: Path, target: Path, edit: dict, message: str) -> None:
    """`head --text` on a copy of `folder` whose config.json has `edit` merged in: exit 2, and one line on stderr
    that says `message`."""
    from attnscope.cli import app

    bad = with_config(folder, target, lambda config: config | edit)
    result = runner.invoke(app, ["head", "--model", str(bad), "--layer", "1", "--head", "0", "--text", SENTENCE])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def cached_builder(tmp_path_factory, build, **options):
    """family -> (folder, eager model), each built by `build(family, folder, ...)` the first time it is asked
    for (a module-scoped fixture's body); `options(family)` gives build's keywords."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            cache[family] = folder, build(family, folder, **{k: v(family) for k, v in options.items()})
        return cache[family]

    return get


def base(model):
    """The base model inside a task model (`model.model`, `model.transformer`, `model.roberta`)."""
    return getattr(model, "base_model", model)


def assert_every_head_dumped(folder: Path, expected_slices, label: str) -> None:
    """Every head of every layer: attnscope's dumped weights (`head_weights`) are `expected_slices(layer, head)`
    (a dict name -> tensor, in that order, sliced from the model's own parameters), bit for bit."""
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model
    from attnscope.models.weights import head_weights

    opened = open_model(folder, read_config(folder))
    for layer in range(opened.n_layer):
        for head in range(opened.n_head):
            weights = head_weights(opened, layer, head).as_torch()
            expected = expected_slices(layer, head)
            assert list(weights) == list(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(weights[name], tensor.detach(), rtol=0, atol=0, msg=f"{label} {name}")
