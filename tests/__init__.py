"""hlopass's test suite: core/ (the engine), passes/<name>/ (one folder per pass), inspection/, tools/, fuzz/ (the
differential fuzzer, JAX's own tests through hlopass, regression tests for what they found)."""

import os

#: The repository's root folder.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
