"""attnscope's results in a notebook (`_repr_html_`): the explorer page where the frontend runs scripts, the
static picture where it does not.

The output is the static view of attnscope/notebook.py (tables, an SVG heatmap, every head: plain HTML, no
script) followed by a small script. A frontend that runs the scripts of an output (JupyterLab and Jupyter
Notebook for a trusted notebook, VS Code, Colab) replaces the static view with the explorer page
(views/explorer.py) in a frame of its own (`srcdoc`: the page's styles and keys stay inside it; the page tells
the frame its height). One that does not (GitHub's viewer, an untrusted notebook, nbconvert to PDF) strips or
ignores the script and shows the static view, so a saved notebook stays readable anywhere, offline.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attnscope.views.explorer import Page, page_html

if TYPE_CHECKING:
    from attnscope.views.sources import Describe

FRAME_HEIGHT = 900  # pixels, until the page says how tall it is


def interactive(static: str, page: Callable[[], Page]) -> str:
    """`static` shown as it is, replaced by the explorer page of `page()` where scripts run."""
    uid = f"attnscope-{uuid.uuid4().hex[:12]}"
    source = json.dumps(page_html(page()), ensure_ascii=True).replace("<", "\\u003c")  # no tag inside the script
    script = (
        "(function(){"
        f"var root=document.getElementById('{uid}');if(!root)return;"
        "var frame=document.createElement('iframe');"
        "frame.title='attnscope explorer';"
        f"frame.style.cssText='width:100%;height:{FRAME_HEIGHT}px;border:0';"
        f"frame.srcdoc={source};"
        "window.addEventListener('message',function(e){"
        "if(e.source===frame.contentWindow&&e.data&&e.data.attnscopeHeight){"
        "frame.style.height=(e.data.attnscopeHeight+4)+'px';}});"
        "root.replaceChildren(frame);})();")
    return f"<div id='{uid}' class='attnscope-view'>{static}</div><script>{script}</script>"


def trace_view(trace: Any, describe: Describe | None = None) -> str:
    """A `Trace` (sdpa, MultiHeadAttention): its steps and its attention (each head's kind from `describe`)."""
    from attnscope.views.notebook import trace_html
    from attnscope.views.sources import from_trace

    return interactive(trace_html(trace), lambda: from_trace(trace, "attnscope", describe=describe))


def head_view(result: Any) -> str:
    """A model head's run (`attnscope.model_head`): the model, the layer's steps, every head on the text."""
    from attnscope.views.notebook import head_html
    from attnscope.views.sources import from_head

    return interactive(head_html(result), lambda: from_head(result))


def heads_view(heads: Any) -> str:
    """Every head of a layer (`LayerHeads`, `.heads` of a result)."""
    from attnscope.views.notebook import heads_html
    from attnscope.views.sources import from_heads

    return interactive(heads_html(heads), lambda: from_heads(heads))


def pattern_view(heatmap: Any, describe: Describe | None = None) -> str:
    """One pattern with its labels (`Heatmap`)."""
    from attnscope.views.notebook import pattern_svg
    from attnscope.views.sources import from_heatmap

    static = pattern_svg(heatmap.matrix, heatmap.row_labels, heatmap.col_labels, heatmap.title)
    return interactive(static, lambda: from_heatmap(heatmap, describe))
