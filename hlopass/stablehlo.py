"""Reading lowered StableHLO modules: the largest tensors and where they come from.

Walks the MLIR module with the Python bindings that ship with jaxlib.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

_TENSOR_RE = re.compile(r"^tensor<(?:((?:\d+x)*)\s*)?([a-z]+\d*)")
_FRAME_RE = re.compile(r'"([^"]+)":(\d+):')
_NAME_RE = re.compile(r'^loc\("([^"]*)"')
_ELEMENT_BITS = {"i1": 8, "pred": 8}
LOOP_OPS = ("stablehlo.while", "mhlo.while")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One op result: its type, byte size, op name and user source line.

    ``loop_result`` marks the results of a loop op itself: its carried state,
    which holds the loop's inputs passed through rather than new values.
    """

    type: str
    nbytes: int
    op: str
    location: str
    in_loop: bool
    loop_result: bool = False

    def __str__(self) -> str:
        from hlopass.sizes import format_size
        where = " (inside a loop body)" if self.in_loop else ""
        return f"{format_size(self.nbytes):>10}  {self.type}  {self.op} at {self.location}{where}"


def tensor_nbytes(type_text: str) -> int:
    """Bytes of a ``tensor<AxBxf32>`` type (0 for tokens and tuples)."""
    match = _TENSOR_RE.match(type_text)
    if not match:
        return 0
    dims = [int(d) for d in (match.group(1) or "").split("x") if d]
    element = match.group(2)
    bits = _ELEMENT_BITS.get(element)
    if bits is None:
        digits = re.search(r"(\d+)$", element)
        bits = int(digits.group(1)) if digits else 32
    return int(np.prod(dims, dtype=np.int64)) * max(bits, 8) // 8


def describe_location(location_text: str) -> tuple[str, str]:
    """``(op name, 'file.py:LINE')`` from an MLIR location's text."""
    name_match = _NAME_RE.match(location_text)
    frame = _FRAME_RE.search(location_text)
    where = f"{os.path.basename(frame.group(1))}:{frame.group(2)}" if frame else "<unknown>"
    return (name_match.group(1) if name_match else ""), where


def all_tensors(module) -> list[TensorInfo]:
    """Every op result in ``module`` (an ``ir.Module``), noting whether it sits inside a loop body."""
    found: list[TensorInfo] = []

    def visit(op, in_loop: bool):
        operation = op.operation
        name = operation.name
        for result in operation.results:
            type_text = str(result.type)
            nbytes = tensor_nbytes(type_text)
            if nbytes:
                op_name, where = describe_location(str(operation.location))
                found.append(TensorInfo(type_text, nbytes, op_name.split("/")[-1] or name, where, in_loop,
                                        loop_result=name in LOOP_OPS))
        inner_loop = in_loop or name in LOOP_OPS
        for region in operation.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child, inner_loop)

    for op in module.body.operations:
        visit(op, False)
    return found


def largest_tensors(module, limit: int = 5, outside_loops: bool = True) -> list[TensorInfo]:
    """The ``limit`` largest op results (by default outside loop bodies), largest first."""
    tensors = [t for t in all_tensors(module) if not (outside_loops and t.in_loop)]
    tensors.sort(key=lambda t: -t.nbytes)
    unique, seen = [], set()
    for t in tensors:
        key = (t.type, t.op, t.location)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    return unique[:limit]


def max_tensor_bytes(module, outside_loops: bool = True, loop_results: bool = True) -> int:
    """Size of the largest op result (outside loop bodies by default; without the loops' own
    carried state when ``loop_results`` is false)."""
    sizes = [t.nbytes for t in all_tensors(module)
             if not (outside_loops and t.in_loop) and (loop_results or not t.loop_result)]
    return max(sizes, default=0)
