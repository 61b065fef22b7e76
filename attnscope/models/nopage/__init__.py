"""Families with no page, through transformers: their attention interface traced
(interface, mask_kind), held against the module's own eager run (interface_check),
layers 0..L (truncated), transformers' eager runs for --check (eager). Every layer and
decoding through them is a view, forward/interface_stream.py. Imports models/' root and the
top level; never families/, forward/ or vision/.
"""
