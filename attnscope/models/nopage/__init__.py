"""Families with no page, through transformers: their attention interface traced
(interface, mask_kind), layers 0..L (truncated), every layer and decoding
(interface_stream). Imports models/' root, forward/ and the top level.
"""
