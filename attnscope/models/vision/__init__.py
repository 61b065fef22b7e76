"""Images for vision towers: reading and checking an image (image.py: `read_image`, `read_header`), the
tokens over the patch grid (patches.py: `Grid`, `patch_labels`, `prefix_names`), the model's own image processor
from its folder (processor.py), the towers through transformers' attention interface (tower.py)."""
