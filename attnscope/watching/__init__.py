"""`attnscope.watch`: the attention of a model the user already holds, recorded at transformers' attention
interface (or at F.scaled_dot_product_attention) without changing what it computes; patterns made afterwards,
in row blocks (docs/python-api.md). The package is `watching`, not `watch`: importing a submodule named `watch`
would set `attnscope.watch` to the module and shadow the function."""

from attnscope.watching.seen import Seen
from attnscope.watching.session import Watch, watch

__all__ = ["Seen", "Watch", "watch"]
