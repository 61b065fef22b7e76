"""Attention as attnscope computes it: reads the AttentionSpec and records every step in a
Trace. dot_product.py (sdpa, the steps every form shares), masking, sinks, position_bias,
multihead (MultiHeadAttention), latent (MLA), textbook (the book's other forms).
Imports the top level (spec, masks, cost, trace, errors, words) and variants/.
"""
