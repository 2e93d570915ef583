"""Writing an :class:`~hlopass.inspection.explanation.Explanation` to a folder (``hlopass-dump``,
``HLOPASS_DUMP_TO``)."""

from __future__ import annotations

import itertools
import json
import os
import re

_counter = itertools.count()


def _folder_name(label: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "function"
    return f"{next(_counter):03d}_{safe}"


def dump_explanation(explanation, out_dir: str, subfolder: bool = True) -> str:
    """Write jaxprs, StableHLO, report and memory figures; returns the folder written."""
    folder = os.path.join(out_dir, _folder_name(explanation.label)) if subfolder else out_dir
    os.makedirs(folder, exist_ok=True)
    files = {
        "original.jaxpr.txt": str(explanation.original_jaxpr),
        "rewritten.jaxpr.txt": str(explanation.rewritten_jaxpr),
        "before.stablehlo.mlir": explanation.stablehlo_before,
        "after.stablehlo.mlir": explanation.stablehlo_after,
        "report.txt": explanation.summary() + "\n",
        "report.json": json.dumps(explanation.to_dict(), indent=2, default=str) + "\n",
    }
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as handle:
            handle.write(text)
    return folder


def dump_on_compile(function, config, args, kwargs) -> None:
    """``HLOPASS_DUMP_TO``: explain ``function`` at ``args`` and write it (with pictures when
    ``HLOPASS_DUMP_FORMAT`` is ``svg`` or ``png``) to a new numbered folder of ``config.dump_to``.

    Called after the function's first compile for a signature; an error here is logged as a
    warning by the caller and never breaks the user's call."""
    from hlopass.inspection.explanation import explain
    from hlopass.settings import ENV_DUMP_FORMAT
    explanation = explain(function, *args, _config=config, **kwargs)
    folder = dump_explanation(explanation, config.dump_to)
    picture_format = os.environ.get(ENV_DUMP_FORMAT, "text").strip().lower()
    if picture_format in ("svg", "png"):
        from hlopass.inspection.draw import draw_explanation
        draw_explanation(explanation, folder, picture_format)
