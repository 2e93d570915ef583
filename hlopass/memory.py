"""Checking a compiled program against the memory limit."""

from __future__ import annotations

import dataclasses
import logging

from hlopass.errors import MemoryLimitError
from hlopass.sizes import format_size
from hlopass.stablehlo import TensorInfo, largest_tensors

logger = logging.getLogger("hlopass")


@dataclasses.dataclass
class MemoryCheck:
    """XLA's memory figures for one compiled program, against the limit."""

    label: str
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    limit: int | None
    largest: list[TensorInfo] = dataclasses.field(default_factory=list)

    @property
    def footprint(self) -> int:
        """Temporaries plus arguments and outputs, less aliased (donated) buffers."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def over_limit(self) -> bool:
        return self.limit is not None and self.footprint > self.limit

    def summary(self) -> str:
        return (f"{self.label}: footprint {format_size(self.footprint)} (temp {format_size(self.temp_bytes)}, "
                f"arguments {format_size(self.argument_bytes)}, outputs {format_size(self.output_bytes)}, "
                f"aliased {format_size(self.alias_bytes)}); limit {format_size(self.limit)}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["footprint"] = self.footprint
        d["largest"] = [dataclasses.asdict(t) for t in self.largest]
        return d


def measure(compiled, lowered=None, limit: int | None = None, label: str = "function",
            list_largest: str = "always") -> MemoryCheck:
    """Read ``compiled.memory_analysis()``; list the largest tensors of ``lowered`` if given
    (``list_largest="over_limit"``: only when the program is over the limit, for the warning)."""
    analysis = compiled.memory_analysis()
    get = lambda name: int(getattr(analysis, name, 0) or 0)  # noqa: E731
    check = MemoryCheck(label=label, temp_bytes=get("temp_size_in_bytes"),
                        argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
                        alias_bytes=get("alias_size_in_bytes"),
                        generated_code_bytes=get("generated_code_size_in_bytes"), limit=limit)
    if lowered is not None and (list_largest == "always" or check.over_limit):
        try:
            check.largest = largest_tensors(lowered.compiler_ir("stablehlo"))
        except Exception as err:  # noqa: BLE001 - the listing is a diagnostic only
            logger.debug("hlopass: could not walk StableHLO of %s: %s", label, err)
    return check


def enforce(check: MemoryCheck, strict: bool) -> None:
    """Warn (or, if ``strict``, raise ``MemoryLimitError``) when ``check`` is over its limit."""
    if not check.over_limit:
        return
    lines = [f"hlopass: {check.summary()} is over the memory limit."]
    if check.largest:
        lines.append("Largest tensors still present:")
        lines.extend(f"  {t}" for t in check.largest)
    lines.append("Lower HLOPASS_TENSOR_SIZE_THRESHOLD / HLOPASS_TENSOR_SPLIT_SIZE, or see hlopass-dump for what was rewritten.")
    message = "\n".join(lines)
    if strict:
        raise MemoryLimitError(message, check)
    logger.warning(message)
