"""Test settings: passes raise instead of being skipped, so failures are visible, and every
pass's result is type-checked (``jax.core.check_jaxpr``). The rewritten program always runs
(``HLOPASS_NEVER_WORSE=0``), so that tests of the passes test their rewrites even where XLA would
prefer the original at test sizes; ``tests/core/test_never_worse.py`` turns it on."""

import os

os.environ.setdefault("HLOPASS_RAISE_PASS_ERRORS", "1")
os.environ.setdefault("HLOPASS_CHECK_PASSES", "1")
for _name in ("HLOPASS_TENSOR_SIZE_THRESHOLD", "HLOPASS_TENSOR_SPLIT_SIZE", "HLOPASS_MEMORY_LIMIT",
              "HLOPASS_PASSES", "HLOPASS_DUMP_TO", "HLOPASS_STRICT", "HLOPASS_MIN_GAIN"):
    os.environ.pop(_name, None)
os.environ["HLOPASS_NEVER_WORSE"] = "0"
