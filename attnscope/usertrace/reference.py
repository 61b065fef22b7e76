"""The reference a user's code is lined up with, run on the same inputs.

- a module: its q, k, v and output projections copied into attnscope's `MultiHeadAttention`: four Linear
  layers matched by name (`W_q`, `q_proj`, `query`, `to_q`, `out_proj`, `o`, ... ); a wrapped
  nn.MultiheadAttention's `in_proj_weight` and `out_proj`; a fused q/k/v Linear split into three (fused.py);
  or, when it has exactly four Linear layers, those in the order they were registered
  (`self.linears = clones(nn.Linear(d, d), 4)`). Grouped-query attention follows from the widths (K and V
  narrower than Q). Steps `Q_feat K_feat V_feat Q_split K_split V_split [Q_rot K_rot] [K_cat V_cat]
  [K_rep V_rep] scores [masked_scores] attention x_raw x_rsh2 x`;
- a function: attnscope's `sdpa`, steps `scores [masked_scores] attention out`.
Both scale the scores by 1/sqrt(d_head) (resp. d_K), as `torch.nn.MultiheadAttention` and
`F.scaled_dot_product_attention` do. `Spec` carries what the options say of the attention (--causal,
--window, --rope, --rope-base, --kv-heads, --cache), whether or not the user's forward takes a mask.

The reference is made in four modules, each doing one thing: refspec.py (Spec, RoPE as the code computes it, the
steps' names), linearweights.py (the code's weights by role, read as Linear layers), projections.py (which layers
are q, k, v and o) and refbuild.py (the reference built from them, and run). This module gathers their public names,
which the line-up and the readings import from here.
"""

from attnscope.usertrace.linearweights import (
    COLUMN_VIEWS,
    NOISE,
    ROLE_WORDS,
    ROLES,
    WEIGHT_WORDS,
    called_bias,
    mentioned,
    parameter_projections,
    parameters_read,
    role_of,
)
from attnscope.usertrace.projections import NO_OUTPUT, SHARED_KV, Projections, find_projections, merge_only
from attnscope.usertrace.refbuild import build_mha, head_widths, run_columns, run_mha, run_sdpa
from attnscope.usertrace.refspec import MHA_STEPS, SDPA_STEPS, Spec, StartedRope, in_run_order, late_norm, steps

__all__ = ["COLUMN_VIEWS", "MHA_STEPS", "NOISE", "NO_OUTPUT", "ROLES", "ROLE_WORDS", "SDPA_STEPS", "SHARED_KV",
           "WEIGHT_WORDS", "Projections", "Spec", "StartedRope", "build_mha", "called_bias", "find_projections",
           "head_widths", "in_run_order", "late_norm", "mentioned", "merge_only", "parameter_projections",
           "parameters_read", "role_of", "run_columns", "run_mha", "run_sdpa", "steps"]
