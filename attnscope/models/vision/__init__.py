"""Images: reading and checking an image (image.py: `read_image`, `read_header`), the tokens over the patch grid
(patches.py: `Grid`, `patch_labels`, `prefix_names`, `Picture`: what the overlays draw on), the model's own image
processor from its folder (processor.py), the vision towers through transformers' attention interface (tower.py:
ViT, DeiT, DINOv2, CLIP's, SigLIP's); and a vision-language model's text with an image (vlm.py places the image's
tokens, vlm_run.py runs the text model on them, vlm_gemma3.py Gemma 3's image-bidirectional mask, vlm_generate.py
decodes after them (--generate), vlm_long.py a long prompt's head in blocks (--rows)). The top of models/: it
imports every other folder of it, and none of them imports it."""
