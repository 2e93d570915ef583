"""hlopass: a memory-safe compiler pass pipeline for JAX.

Use ``@hlopass.jit`` instead of ``@jax.jit``; see the README for settings.
"""

from hlopass import api as _api
from hlopass.api import HlopassFunction, jit
from hlopass.config import Config
from hlopass.errors import ConfigError, ConfigWarning, MemoryLimitError
from hlopass.inspection.dump import dump_on_compile as _dump_on_compile
from hlopass.inspection.explanation import Explanation, explain, reports
from hlopass.pass_base import Pass
from hlopass import registry as _registry
from hlopass.registry import available_passes, register_pass
from hlopass.report import Note, PassReport, PipelineReport, Rewrite, Skip
from hlopass.settings import resolve as resolve_config
from hlopass.sizes import format_size, parse_size

# The composition root: HLOPASS_DUMP_TO makes the API call the dump writer of the inspection tools.
_api.compile_listeners.append(_dump_on_compile)
_registry.import_default_passes()

__all__ = [
    "jit", "explain", "reports", "HlopassFunction", "Explanation", "Config", "resolve_config", "ConfigError",
    "ConfigWarning", "MemoryLimitError", "Pass", "register_pass", "available_passes", "Note", "PassReport",
    "PipelineReport",
    "Rewrite", "Skip", "parse_size", "format_size",
]
__version__ = "0.1.0"
