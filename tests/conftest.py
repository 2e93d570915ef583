"""Test settings: passes raise instead of being skipped, so failures are visible."""

import os

os.environ.setdefault("HLOPASS_RAISE_PASS_ERRORS", "1")
for _name in ("HLOPASS_TENSOR_SIZE_THRESHOLD", "HLOPASS_TENSOR_SPLIT_SIZE", "HLOPASS_MEMORY_LIMIT",
              "HLOPASS_PASSES", "HLOPASS_DUMP_TO", "HLOPASS_STRICT"):
    os.environ.pop(_name, None)
