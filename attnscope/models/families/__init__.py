"""One page per family: its base chain on its first line, what its checkpoint calls
each weight, where head h lives, its attention's specifics. Imports models/' root,
nopage/ (a reference run through transformers), attention/, variants/ and the top level; never
forward/ or vision/ (tests/test_layout.py: models/' folders in order).
"""
