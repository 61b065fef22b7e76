"""How many examples the property-based tests try: a small number by default, so the suite stays quick in
CI, and `ATTNSCOPE_FUZZ_EXAMPLES=N` for a long run (every property test takes the same N)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_settings(default: int) -> settings:
    examples = int(os.environ.get("ATTNSCOPE_FUZZ_EXAMPLES", default))
    return settings(max_examples=examples, deadline=None, derandomize="ATTNSCOPE_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
