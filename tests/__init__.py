"""hlopass's test suite: core/ (the engine), passes/<name>/ (one folder per pass), inspection/, tools/."""

import os

#: The repository's root folder.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
