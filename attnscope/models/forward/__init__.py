"""Running a family's layers, one forward for many views: layers 0..L with L traced
(run), every layer and greedy decoding (stream), a long input in blocks (long), the
encoder-decoders' (seq2seq_*), and every layer and decoding for a family with no page,
through transformers' own forward (interface_stream). Imports models/' root, families/
(encoder-decoders), nopage/ (interface_stream) and attention/; never vision/.
"""
