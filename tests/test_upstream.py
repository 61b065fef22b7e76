"""attnscope on a transformers release with a bug in a reference it runs (attnscope/models/nopage/upstream.py).

transformers 5.24.0's Llama4ForConditionalGeneration.forward raises AttributeError ('image_outputs') on every
input, so `--check` on a Llama 4 VLM was an internal error there. The run is a subprocess: the tests' own conftest
gives transformers the same fix for their reference runs, process-wide, and would hide the bug in-process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def llama4_vlm(tmp_path_factory):
    from tiny_vlm import build

    folder = tmp_path_factory.mktemp("llama4_vlm")
    build("llama4", folder)
    image = folder / "picture.png"
    Image.fromarray((np.random.default_rng(0).random((60, 80, 3)) * 255).astype("uint8")).save(image)
    return folder, image


@pytest.mark.parametrize("extra", [[], ["--generate", "2"]])
def test_check_on_a_llama4_vlm_runs_transformers_reference(llama4_vlm, extra):
    folder, image = llama4_vlm
    done = subprocess.run([sys.executable, "-m", "attnscope", "head", "--model", str(folder), "--image", str(image),
                           "--text", "Describe", "--layer", "1", "--head", "0", "--check", "--json", *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["check_passed"] is True
    assert report["check"] and all(c["passed"] for c in report["check"])


def test_the_fix_is_undone_on_leaving():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    from attnscope.models.nopage.upstream import reference_fixes

    before = "image_outputs" in vars(MoeCausalLMOutputWithPast)
    with reference_fixes():
        assert getattr(MoeCausalLMOutputWithPast, "image_outputs", None) is None
    assert ("image_outputs" in vars(MoeCausalLMOutputWithPast)) == before
