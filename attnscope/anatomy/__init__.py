"""`attnscope anatomy`: every layer's attention from config.json alone, without torch: the
config with transformers' defaults under it (config.py, defaults.json), each family's layer
kinds (kinds.py), the anatomy (read.py). Imports models/' config and hub, and errors.
"""
