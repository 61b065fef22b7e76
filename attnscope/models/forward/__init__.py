"""Running a family's layers, one forward for many views: layers 0..L with L traced
(run), every layer and greedy decoding (stream), a long input in blocks (long), the
encoder-decoders' (seq2seq_*). Imports models/' root, families/ (encoder-decoders)
and attention/.
"""
