"""What passes need to know about JAX's distribution: how values are sharded, and the manual axes of
``shard_map`` bodies.

* :func:`dim_shards` - into how many pieces each dimension of a value is cut across devices: read
  from the value's type under an ``Explicit`` mesh (:func:`sharding_pieces` reads a
  ``with_sharding_constraint``'s), or, for the program's inputs under an ``Auto``
  mesh, from the shardings of the ``jax.jit`` arguments they are (found by the ``hlopass_call``
  lowering rule in the module's ``sdy.sharding`` argument attributes, :func:`operand_shards`, and
  made known to the passes with :func:`inputs_sharded`). :func:`input_shardings` gives the same
  inputs' ``NamedSharding`` s (:func:`operand_shardings` builds them from those attributes; a pass
  compiles a program with them, in :func:`mesh_of`, to measure one device's memory).
* :func:`body_context` / :func:`manual_context` - the context (axis names bound, the mesh with its
  manual axes, varying-axes checking) in which a ``shard_map`` body, or a program lowered inside one,
  is re-traced: without it a collective or ``pcast`` in the body fails with "unbound axis name".
* :func:`conform` - a value given the varying manual axes and the explicit sharding of a type (loop
  carries initialised outside a body must have the type the body returns).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import Any, Sequence

import jax
from hlopass import internals as jx

_INPUT_SHARDS: contextvars.ContextVar = contextvars.ContextVar("hlopass_input_shards", default=None)
_INPUT_SHARDINGS: contextvars.ContextVar = contextvars.ContextVar("hlopass_input_shardings", default=None)


# -- shardings of values ----------------------------------------------------------------------------

def type_shards(aval) -> tuple[int, ...] | None:
    """Pieces per dimension of a value whose type carries an explicit sharding; ``None`` otherwise."""
    shape = getattr(aval, "shape", None)
    return None if shape is None else sharding_pieces(getattr(aval, "sharding", None), len(shape))


def sharding_pieces(sharding, rank: int) -> tuple[int, ...] | None:
    """Pieces per dimension of a ``NamedSharding`` of a rank-``rank`` value (``None``: whole everywhere)."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return None
    sizes = dict(mesh.shape)
    pieces = [math.prod(sizes.get(name, 1) for name in _axis_names(spec[k] if k < len(spec) else None))
              for k in range(rank)]
    return tuple(pieces) if any(p > 1 for p in pieces) else None


def type_axis(aval, dim: int) -> tuple[Any, str] | None:
    """``(mesh, name)`` when dimension ``dim`` of a value's explicitly sharded type is cut along the one
    mesh axis ``name`` (over more than one device); ``None`` otherwise (an ``Auto`` mesh's values, a
    dimension whole or cut along several axes)."""
    sharding = getattr(aval, "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True) or dim >= len(spec):
        return None
    names = _axis_names(spec[dim])
    if len(names) != 1 or dict(mesh.shape).get(names[0], 1) < 2:
        return None
    return mesh, names[0]


def _axis_names(entry) -> tuple:
    """The mesh axis names of one entry of a ``PartitionSpec`` (``None``, a name, or a tuple of names)."""
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def input_shards() -> tuple | None:
    """Pieces per dimension of each input of the program being rewritten (``None`` where unknown)."""
    return _INPUT_SHARDS.get()


def input_shardings() -> tuple | None:
    """The ``NamedSharding`` of each input of the program being rewritten (``None`` where unknown)."""
    return _INPUT_SHARDINGS.get()


@contextlib.contextmanager
def inputs_sharded(shards: Sequence[tuple[int, ...] | None] | None, shardings: Sequence[Any] | None = None):
    """Within: :func:`input_shards` is ``shards`` and :func:`input_shardings` is ``shardings``
    (one entry per program input)."""
    known = shards is not None and any(shards)
    token = _INPUT_SHARDS.set(tuple(shards) if known else None)
    token2 = _INPUT_SHARDINGS.set(tuple(shardings) if known and shardings is not None
                                  and len(shardings) == len(shards) else None)
    try:
        yield
    finally:
        _INPUT_SHARDINGS.reset(token2)
        _INPUT_SHARDS.reset(token)


def dim_shards(var, jaxpr=None) -> tuple[int, ...] | None:
    """Pieces per dimension of ``var``: its explicit type's, or (an input of the top-level program
    ``jaxpr``) its jax.jit argument's; ``None`` when it is whole on every device or unknown."""
    found = type_shards(getattr(var, "aval", None))
    if found is not None or jaxpr is None:
        return found
    shards = _INPUT_SHARDS.get()
    if shards is None or len(shards) != len(jaxpr.invars):
        return None
    for invar, entry in zip(jaxpr.invars, shards):
        if invar is var:
            return entry if entry is not None and len(entry) == len(var.aval.shape) else None
    return None


def axis_is_sharded(var, axis: int | None, jaxpr=None) -> bool:
    """Whether dimension ``axis`` of ``var`` is cut across devices."""
    if axis is None:
        return False
    pieces = dim_shards(var, jaxpr)
    return pieces is not None and axis < len(pieces) and pieces[axis] > 1


def _dynamic_leaves(checked, args, kwargs) -> list:
    if checked.static_argnums or checked.static_argnames:
        args = tuple(a for i, a in enumerate(args) if i not in checked.static_argnums)
        kwargs = {k: v for k, v in kwargs.items() if k not in checked.static_argnames}
    return jax.tree_util.tree_leaves((args, kwargs))


def argument_shards(checked, args, kwargs) -> tuple | None:
    """Pieces per dimension of each dynamic argument leaf of a call of ``checked`` (a
    :class:`~hlopass.checked.CheckedJit`), in the order the ``hlopass_call`` receives them."""
    found = []
    for leaf in _dynamic_leaves(checked, args, kwargs):
        shape = getattr(leaf, "shape", None)
        found.append(None if shape is None else sharding_pieces(getattr(leaf, "sharding", None), len(shape)))
    return tuple(found) if any(found) else None


def argument_shardings(checked, args, kwargs) -> tuple:
    """The ``NamedSharding`` of each dynamic argument leaf (as :func:`argument_shards`; ``None`` for others)."""
    return tuple(leaf.sharding if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding) else None
                 for leaf in _dynamic_leaves(checked, args, kwargs))


# -- the lowering rule's view of its operands ----------------------------------------------------------

_AXIS = re.compile(r'"([^"]+)"(?::\((\d+)\)(\d+))?')
_MESH_AXIS = re.compile(r'"([^"]+)"\s*=\s*(\d+)')


def operand_shards(ctx, args: Sequence[Any]) -> tuple | None:
    """Pieces per dimension of each operand of a lowering rule that is an argument of the module's
    entry function carrying an ``sdy.sharding`` attribute (``None`` for the others); ``None`` when
    no operand is known to be sharded."""
    try:
        from hlopass import internals as jx
    except ImportError:  # pragma: no cover - jaxlib always ships its MLIR bindings
        return None
    found = []
    for arg, aval in zip(args, ctx.avals_in):
        value = arg[0] if isinstance(arg, (tuple, list)) and len(arg) == 1 else arg
        entry = None
        if isinstance(value, jx.ir.BlockArgument):
            try:
                entry = _block_argument_shards(ctx.module_context.module, value, len(getattr(aval, "shape", ())))
            except Exception:  # noqa: BLE001 - unknown attribute forms: treated as not sharded
                entry = None
        found.append(entry)
    return tuple(found) if any(found) else None


def _block_argument_shards(module, value, rank: int) -> tuple[int, ...] | None:
    text = _block_argument_sdy(value)
    return None if text is None else parse_sdy_sharding(text, _module_meshes(module), rank)


def _block_argument_sdy(value) -> str | None:
    func = value.owner.owner
    if "arg_attrs" not in func.attributes:
        return None
    text = str(func.attributes["arg_attrs"][value.arg_number])
    start = text.find("#sdy.sharding<")
    return None if start < 0 else text[start:]


def operand_shardings(ctx, args: Sequence[Any]) -> tuple | None:
    """As :func:`operand_shards`, each operand's ``NamedSharding`` over the devices of the lowering
    (``None`` for operands without one, or when the devices are not known)."""
    devices = getattr(getattr(ctx.module_context, "axis_context", None), "device_assignment", None)
    if not devices:  # not set when lowering for Shardy: any devices of the platform make the same partitioning
        devices = jax.local_devices()
        if len(devices) < getattr(ctx.module_context.axis_context, "num_devices", 1):
            devices = jax.devices()
    try:
        from hlopass import internals as jx
    except ImportError:  # pragma: no cover
        return None
    found = []
    for arg, aval in zip(args, ctx.avals_in):
        value = arg[0] if isinstance(arg, (tuple, list)) and len(arg) == 1 else arg
        entry = None
        if isinstance(value, jx.ir.BlockArgument):
            try:
                text = _block_argument_sdy(value)
                entry = None if text is None else _named_sharding(
                    text, _module_meshes(ctx.module_context.module), len(getattr(aval, "shape", ())), devices,
                    getattr(getattr(aval, "sharding", None), "mesh", None))
            except Exception:  # noqa: BLE001 - unknown attribute forms: not known
                entry = None
        found.append(entry)
    return tuple(found) if any(e is not None for e in found) else None


def mesh_of(shardings: Sequence[Any] | None):
    """A context with the mesh of the first of ``shardings`` on explicit axes set (``jax.set_mesh``):
    a program whose types carry explicit shardings is lowered in it; nothing otherwise."""
    for s in shardings or ():
        mesh = getattr(s, "mesh", None)
        if mesh is not None and any(t == jx.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
            return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def typed_mesh(tree):
    """The explicit mesh the values of ``tree`` are typed on, entered when the context has none
    (``jax.make_jaxpr`` of a function of such values outside it traces a ``vmap`` of a
    custom-derivative call over them onto an empty mesh, and JAX refuses the result); else a null
    context."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return jx.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


def explicit_mesh(closed) -> Any | None:
    """The mesh of the first explicitly sharded type among ``closed``'s inputs and outputs, else ``None``."""
    for aval in (*closed.in_avals, *closed.out_avals):
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if any(t == jx.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
            return mesh
    return None


def _named_sharding(text: str, meshes: dict[str, dict[str, int]], rank: int, devices, typed_mesh=None):
    """A ``NamedSharding`` for an ``#sdy.sharding<...>`` attribute's text (``None`` for sub-axes or a rank
    mismatch); the mesh takes the axis types of ``typed_mesh`` (an explicit type's), else ``Auto``."""
    import numpy as np
    body = text[len("#sdy.sharding<"):].lstrip()
    if body.startswith("mesh<"):
        end = body.index("]>") + 2
        sizes = {k: int(v) for k, v in _MESH_AXIS.findall(body[:end])}
    elif body.startswith("@"):
        end = body.index(",")
        sizes = meshes.get(body[1:end].strip(), {})
    else:
        return None
    rest = body[end:]
    open_at = rest.index("[")
    groups = re.findall(r"\{([^}]*)\}", rest[open_at + 1:rest.index("]", open_at)])
    if len(groups) != rank or not sizes or math.prod(sizes.values()) > len(devices):
        return None
    spec = []
    for group in groups:
        names = []
        for name, sub, _ in _AXIS.findall(group):
            if sub or name not in sizes:
                return None
            names.append(name)
        spec.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    names = tuple(sizes)
    types = dict(zip(getattr(typed_mesh, "axis_names", ()), getattr(typed_mesh, "axis_types", ())))
    axis_types = tuple(types.get(n, jx.AxisType.Auto) for n in names)
    grid = np.array(list(devices)[:math.prod(sizes.values())], dtype=object).reshape(tuple(sizes.values()))
    mesh = jax.sharding.Mesh(grid, names, axis_types=axis_types)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _module_meshes(module) -> dict[str, dict[str, int]]:
    meshes = {}
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            name = str(op.attributes["sym_name"]).strip('"')
            meshes[name] = {k: int(v) for k, v in _MESH_AXIS.findall(str(op.attributes["mesh"]))}
    return meshes


def parse_sdy_sharding(text: str, meshes: dict[str, dict[str, int]], rank: int) -> tuple[int, ...] | None:
    """Pieces per dimension of an ``#sdy.sharding<mesh, [{dims}...]>`` attribute's text."""
    body = text[len("#sdy.sharding<"):].lstrip()
    if body.startswith("mesh<"):
        end = body.index("]>") + 2
        sizes = {k: int(v) for k, v in _MESH_AXIS.findall(body[:end])}
    elif body.startswith("@"):
        end = body.index(",")
        sizes = meshes.get(body[1:end].strip(), {})
    else:
        return None
    rest = body[end:]
    open_at = rest.index("[")
    dims_text = rest[open_at + 1:rest.index("]", open_at)]
    groups = re.findall(r"\{([^}]*)\}", dims_text)
    if len(groups) != rank:
        return None
    pieces = []
    for group in groups:
        count = 1
        for name, _, sub_size in _AXIS.findall(group):
            count *= int(sub_size) if sub_size else sizes.get(name, 1)
        pieces.append(count)
    return tuple(pieces) if any(p > 1 for p in pieces) else None


# -- manual axes (shard_map) ------------------------------------------------------------------------

def _manual_mesh_context(mesh, manual_axes, check_vma: bool | None):
    stack = contextlib.ExitStack()
    all_manual = set(manual_axes) | set(getattr(mesh, "manual_axes", ()))
    stack.enter_context(jx.extend_axis_env_nd([(k, v) for k, v in mesh.shape.items() if k in all_manual]))
    abstract = mesh.abstract_mesh if hasattr(mesh, "abstract_mesh") else mesh
    stack.enter_context(jx.use_abstract_mesh(
        abstract.update_axis_types({n: jx.AxisType.Manual for n in all_manual})))
    if check_vma is not None:
        stack.enter_context(jx.check_vma(check_vma))
    return stack


def body_context(eqn):
    """The context in which a sub-jaxpr of ``eqn`` is re-traced: a ``shard_map`` body's manual axes
    bound (names, manual mesh, varying-axes checking); nothing for other equations."""
    if eqn.primitive.name != "shard_map":
        return contextlib.nullcontext()
    params = eqn.params
    manual = params.get("newly_manual_axes", frozenset(params["mesh"].axis_names))
    return _manual_mesh_context(params["mesh"], manual, params.get("check_vma"))


def manual_context(ctx):
    """For a lowering rule inside a ``shard_map`` body: the same context as :func:`body_context`,
    from the lowering's axis context (re-tracing the program there needs the axis names)."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    if not manual or mesh is None:
        return contextlib.nullcontext()
    return _manual_mesh_context(mesh, frozenset(manual), None)


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which a value varies (its type's ``{V:...}``)."""
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    found = getattr(mat, "varying", None)
    return frozenset(found if found is not None else getattr(aval, "vma", ()))


def distributed_type(aval) -> bool:
    """Whether ``aval`` varies along manual axes or lives on a mesh with explicit axes."""
    return bool(varying_axes(aval)) or _explicit(getattr(aval, "sharding", None))


def conform(value, aval):
    """``value`` cast to ``aval``'s varying manual axes (``pcast``) and explicit sharding (``reshard``)."""
    vma = varying_axes(aval)
    if vma:
        have = varying_axes(jx.typeof(value))
        missing = tuple(sorted(a for a in vma if a not in have))
        if missing:
            value = jax.lax.pcast(value, missing, to="varying")
    target = getattr(aval, "sharding", None)
    current = getattr(jx.typeof(value), "sharding", None)
    if _explicit(target):
        if getattr(current, "spec", None) != target.spec or getattr(current, "mesh", None) != target.mesh:
            value = jax.sharding.reshard(value, target)
    elif _explicit(current) and any(entry is not None for entry in current.spec):
        value = jax.sharding.reshard(value, current.update(spec=jax.sharding.PartitionSpec()))
    return value


def _explicit(sharding) -> bool:
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or getattr(sharding, "spec", None) is None:
        return False
    return any(t == jx.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
