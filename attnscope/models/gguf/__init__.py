"""GGUF files (llama.cpp, Ollama, LM Studio) read lazily, as a model folder: the metadata as a config.json
(config.py), the tensors in transformers' names, memory-mapped and dequantized one at a time when a layer asks
for them (checkpoint.py, with the header and tensor table read and checked first: header.py, quants.py), the
tokenizer from the metadata (tokenizer.py), and where `--model` finds the file (open.py: a file, a folder, a
split model's shards, `ollama:NAME[:TAG]`), the special tokens a tokenizer adds (post_processor.py, the root's
tokenizer.py's too). The family pages run on it unchanged. Imports nothing of models/ outside gguf/.
"""
