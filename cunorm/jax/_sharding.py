"""The jit primitives inside programs partitioned over several GPUs.

Each primitive's arrays are described by the roles of their dimensions
(``Layout``): a label per dimension, the labels that must not be split
across shards (the normalized axes; every axis of a statistic that spans
the batch), and the results summed across shards (dweight, dbias). From
that one description come the rule XLA's partitioner propagates
(Shardy's einsum-like string, or the operands' shardings for GSPMD) and
the partition itself: every operand and result takes the first operand's
sharding on the labels it may keep, the kernels run on each shard's
block, and a summed result is added across the mesh axes its missing
labels were split over (``psum``, XLA's all-reduce).

A call on one device, inside ``shard_map`` (every mesh axis manual), or
lowered without devices (``jax.export`` for a named target) lowers as
before, with no partitioning call.

Private API used (the versions cunorm/jax/_custom_call.py supports):
``jax._src.custom_partitioning`` (its lowering rule, which registers the
partition callbacks with XLA) and ``dispatch.prim_requires_devices_during_lowering``
(so jit hands the lowering its devices and mesh).
"""
from __future__ import annotations

import dataclasses

import jax
from jax._src import custom_partitioning as _cp
from jax._src import dispatch, sharding_impls
from jax._src.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

try:
    from jax.extend.core import Primitive
except ImportError:  # (older jax)
    from jax.core import Primitive


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dimensions' labels of a primitive's operands and results, in
    order; ``whole``: labels never split across shards (nor is any label
    the first operand lacks); ``summed``: the indices of the results added
    across shards, over the mesh axes of every label of the first operand
    they lack."""

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    whole: frozenset = frozenset()
    summed: frozenset = frozenset()

    def rule(self) -> tuple[str, dict]:
        """Shardy's sharding rule: the einsum-like string and its factors
        that need replication."""
        text = ", ".join(" ".join(o) for o in self.operands) + " -> " + ", ".join(" ".join(r) for r in self.results)
        used = {label for dims in self.operands + self.results for label in dims}
        whole = (self.whole & used) | (used - set(self.operands[0]))
        return text, {"need_replication_factors": tuple(sorted(whole))}


def labels(ndim: int) -> tuple[str, ...]:
    """The labels of an operand's dimensions, in order."""
    return tuple(f"d{i}" for i in range(ndim))


def fresh(n: int, start: int = 0) -> tuple[str, ...]:
    """Labels of dimensions of no operand (a result's groups, a size-1
    axis): never split."""
    return tuple(f"e{i}" for i in range(start, start + n))


def register(prim: Primitive, lowering, layout_of, localize) -> None:
    """Lower ``prim`` with ``lowering`` on one device and on each shard of a
    partitioned program. ``layout_of(spec)``: its Layout; ``localize(spec,
    shape)``: the spec of a shard whose first operand has ``shape``."""
    local = Primitive(prim.name + "_shard")
    local.multiple_results = True
    local.def_abstract_eval(lambda *args, spec: prim.abstract_eval(*args, spec=spec)[0])
    mlir.register_lowering(local, lowering, platform="cuda")
    dispatch.prim_requires_devices_during_lowering.add(prim)

    def partitioned(ctx, *args, spec):
        if not _partitioned(ctx.module_context.axis_context):
            return lowering(ctx, *args, spec=spec)
        layout = layout_of(spec)
        call = jax.make_jaxpr(lambda *a: local.bind(*a, spec=spec))(*ctx.avals_in)
        in_tree = jax.tree_util.tree_structure(tuple(range(len(args))))
        out_tree = jax.tree_util.tree_structure(list(range(len(ctx.avals_out))))

        def shardings(mesh, arg_shapes):
            return _shardings(layout, mesh, arg_shapes[0].sharding)

        def partition(spec, mesh, arg_shapes, result_shapes):
            first, ins, outs, sums = shardings(mesh, arg_shapes)
            local_spec = spec if first is None else localize(spec, tuple(first.shard_shape(arg_shapes[0].shape)))

            def lower_fn(*shard_args):
                results = list(local.bind(*shard_args, spec=local_spec))
                for i, axes in sums.items():
                    if axes:
                        results[i] = jax.lax.psum(results[i], axes)
                return results

            return mesh, lower_fn, outs, ins

        def infer(spec, mesh, arg_shapes, result_shapes):
            return shardings(mesh, arg_shapes)[2]

        text, factors = layout.rule()
        return _cp._custom_partitioning_lowering_rule(
            ctx, *args, call=call, in_tree=in_tree, out_tree=out_tree, propagate_user_sharding=None,
            partition=partition, infer_sharding_from_operands=infer, decode_shardings=True,
            sharding_rule=lambda *static_and_types: (text, factors), static_args=(spec,))

    mlir.register_lowering(prim, partitioned, platform="cuda")


def _partitioned(axis_context) -> bool:
    """Whether the program is partitioned over several devices by XLA (not
    manually, as inside shard_map), with the devices known."""
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1 and axis_context.device_assignment is not None
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    return False


def _shardings(layout: Layout, mesh, given):
    """(first operand's kept sharding or None, operands', results', {result:
    mesh axes summed over}) for the first operand sharded as ``given``. A
    sharding that names no mesh (GSPMD's, without one in scope) keeps
    nothing: every array whole on every shard."""
    if not isinstance(given, NamedSharding):
        whole = sharding_impls.GSPMDSharding.get_replicated(given._device_assignment)
        return None, (whole,) * len(layout.operands), [whole] * len(layout.results), {}
    spec = tuple(given.spec) + (None,) * (len(layout.operands[0]) - len(given.spec))
    axes = {label: (None if label in layout.whole else entry) for label, entry in zip(layout.operands[0], spec)}

    def sharding(dims):
        return NamedSharding(given.mesh, PartitionSpec(*[axes.get(label) for label in dims]))

    first = sharding(layout.operands[0])
    sums = {}
    for i in layout.summed:
        missing = [axes[label] for label in layout.operands[0] if label not in layout.results[i]]
        sums[i] = tuple(name for entry in missing if entry is not None
                        for name in (entry if isinstance(entry, tuple) else (entry,)))
    return first, tuple(sharding(o) for o in layout.operands), [sharding(r) for r in layout.results], sums
