"""Record transformers' `Llama4ImageProcessor` on tests/llama4_tile_cases.py's pictures and settings into
tests/references/llama4_tiles.safetensors: the reference attnscope's torchvision-free copy
(attnscope/models/vision/llama4_tiles.py) is held to in tests/test_llama4_tiles.py.

Llama4ImageProcessor needs torchvision, which does not install beside the CPU-only torch of attnscope's own
set-up, so this runs in a separate environment that has both, e.g.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch torchvision transformers pillow safetensors
    /tmp/tv/bin/python scripts/llama4_tiles_reference.py

It records the versions it ran with in the file's metadata, and with --compare also runs attnscope's copy there
(attnscope importable) and prints the largest difference per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
OUT = ROOT / "tests" / "references" / "llama4_tiles.safetensors"


def main() -> None:
    import torch
    import torchvision
    import transformers
    from llama4_tile_cases import FLOAT_PATH, SETTINGS, cases, picture
    from safetensors.torch import save_file
    from transformers import Llama4ImageProcessor

    tensors = {}
    for key, image, setting in cases():
        made = Llama4ImageProcessor(**SETTINGS[setting])(images=[picture(image)], return_tensors="pt")
        tensors[f"{key}/pixel_values"] = made["pixel_values"].contiguous()
        tensors[f"{key}/aspect_ratios"] = made["aspect_ratios"].contiguous()
    # torchvision resizes uint8 on the CPU natively only with AVX2/AVX512 (or ARM); elsewhere in float32, rounded
    # back: the same pictures through that path, with the CPU's capability reported as plain
    capability = torch.backends.cpu.get_cpu_capability
    torch.backends.cpu.get_cpu_capability = lambda: "DEFAULT"
    try:
        for key, image, setting in FLOAT_PATH:
            made = Llama4ImageProcessor(**SETTINGS[setting])(images=[picture(image)], return_tensors="pt")
            tensors[f"{key}/pixel_values"] = made["pixel_values"].contiguous()
            tensors[f"{key}/aspect_ratios"] = made["aspect_ratios"].contiguous()
    finally:
        torch.backends.cpu.get_cpu_capability = capability
    metadata = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                "transformers": transformers.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}
    if "--compare" in sys.argv:
        from attnscope.models.vision import llama4_tiles

        for key, image, setting in [*cases(), *FLOAT_PATH]:
            if key.startswith("float32_path/"):
                torch.backends.cpu.get_cpu_capability = lambda: "DEFAULT"
            ours = llama4_tiles.make(SETTINGS[setting])(images=[picture(image)], return_tensors="pt")
            torch.backends.cpu.get_cpu_capability = capability
            theirs = tensors[f"{key}/pixel_values"]
            same = ours["pixel_values"].shape == theirs.shape and torch.equal(ours["aspect_ratios"],
                                                                              tensors[f"{key}/aspect_ratios"])
            diff = (ours["pixel_values"].float() - theirs.float()).abs().max().item() if same else float("nan")
            print(f"{key:40} {tuple(theirs.shape)!s:22} max |ours - transformers| {diff}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata=metadata)
    print(f"{len(tensors) // 2} cases, {metadata} -> {OUT}")


if __name__ == "__main__":
    main()
