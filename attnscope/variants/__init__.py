"""The math of one variant of attention: RoPE (its scaling, its config), ALiBi, temperature
tuning, qk-norm. Functions of tensors and numbers: they read no AttentionSpec and record no
step. Imports errors (and one another), nothing else of attnscope.
"""
