"""`attnscope trace`: run the user's own attention code, record every tensor op, line it up with attnscope's.

- load.py: import the user's file under a private name, parse `--init`, read the callable's signature;
- sizes.py: sizes chosen so every named dim differs, and axes named from their sizes;
- inputs.py: the inputs and mask the signature asks for;
- record.py: the `TorchFunctionMode` that records every tensor op with the user's line;
- bindings.py: which name the user bound each result to (the assignment target, read with ast);
- call.py: the call under the recorder, and the user's exception kept as theirs;
- reference.py: the user's Linear weights copied into attnscope's `MultiHeadAttention`, or `sdpa` (refspec.py:
  what it computes; linearweights.py: the code's weights by role; projections.py: which are q, k, v and o;
  refbuild.py: the reference built and run);
- align.py: whether a user tensor equals a reference step, in which layout;
- lineup.py: each reference step's equal, and the first divergence (lined.py: what a line-up is; conventionread.py:
  under the code's conventions; underspec.py: under one spec; refruns.py: the reference's run; alignsteps.py: the
  steps lined up; firststep.py: the first divergence; ranking.py: which line-up fits better);
- diagnose.py: the common causes of a divergence, each computed from the numbers.

No terminal code here; attnscope.runs.trace ties it together and attnscope.render.usertrace shows it.
"""
