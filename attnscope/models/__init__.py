"""Models: one module per family (bert, ...), the lazy checkpoint reader and the Hugging Face cache lookup."""
