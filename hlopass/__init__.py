"""hlopass: a memory-safe compiler pass pipeline for JAX.

Use ``@hlopass.jit`` instead of ``@jax.jit``; see the README for settings.
"""

from hlopass import primitive as _primitive  # noqa: F401  (registers the hlopass_call primitive)
from hlopass.api import HlopassFunction, jit
from hlopass.config import Config, resolve as resolve_config
from hlopass.errors import ConfigError, MemoryLimitError
from hlopass.explain import Explanation, explain
from hlopass.pass_base import Pass
from hlopass.registry import available_passes, register_pass
from hlopass.report import PassReport, PipelineReport, Rewrite, Skip
from hlopass.sizes import format_size, parse_size

__all__ = [
    "jit", "explain", "HlopassFunction", "Explanation", "Config", "resolve_config", "ConfigError",
    "MemoryLimitError", "Pass", "register_pass", "available_passes", "PassReport", "PipelineReport",
    "Rewrite", "Skip", "parse_size", "format_size",
]
__version__ = "0.1.0"
