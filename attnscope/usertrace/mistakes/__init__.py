"""The catalog of mistakes, by kind: each module the trials of its entries (usertrace/experiments.py lists
them as the catalog, in the order they are tried)."""
