"""Every kernel of cunorm/kernels/, declared once: its template parameters
and its typed argument list, as the ``.cu`` file writes them.

From a declaration come the instantiation's name (``decl(...)`` formats the
template arguments, all from closed sets or numbers cunorm formats itself;
a load or store stage, cunorm/kernels/stages.cuh, is a ``Stage``),
the catalogue's entries (``Kernel``) and the argument packing of a launch
(``Kernel.signature``: each argument's name and C kind, read by
cunorm/_engine/launches.py). tests/engine/test_kernels.py parses the ``.cu`` signatures and
checks them against these declarations, so a kernel whose C++ signature
changes without its declaration fails on a CPU.

Argument kinds: pointers (8 bytes) by what the kernel does with the memory,
``in`` (reads it: a ``const`` pointer), ``out`` (writes it; what it reads
there it wrote itself, or the launcher zeroed) and ``io`` (reads what the caller had there and
updates it in place: BatchNorm's running statistics); ``i32`` (int),
``i64`` (long long) and ``acc`` (the accumulation type: float, or double
where the data ``T`` or the accumulation ``A`` template argument is double).

Every kernel lists its ``in`` and ``io`` pointers before its ``out``
pointers: XLA's custom call (cunorm/jax/_jit.py) binds a kernel's pointer
arguments to the call's operands and then its results, in order.
tests/engine/test_kernels.py checks both the order and that ``in`` is what the
``.cu`` declares ``const``.

A kernel with a ``block_x`` argument has a 2-D thread layout over its 1-D
block (common.cuh's BlockLayout): the launcher passes the step's block x
extent there and launches the block's threads 1-D.
"""
from __future__ import annotations

from dataclasses import dataclass, field

POINTER_KINDS = ("in", "out", "io")
KINDS = POINTER_KINDS + ("i32", "i64", "acc")


@dataclass(frozen=True)
class Kernel:
    """One template instantiation, as the dispatch picks it."""

    family: str  # source file stem in cunorm/kernels/
    expression: str  # the template instantiation, e.g. cunorm::rows_cached<...>
    cooperative: bool = False  # launched cooperatively (all blocks co-resident)
    #: a persistent grid (blocks loop over the work by gridDim): the launcher
    #: caps it at the blocks that fit on the GPU at once, so no block starts
    #: its share late
    persistent: bool = False
    #: the oldest compute capability it compiles for (thread-block clusters: 90)
    min_arch: int = 0
    #: (name, kind) of each argument in order, kinds resolved (acc -> f32 / f64)
    signature: tuple = ()
    #: the declaration's name and the template arguments it was made from
    #: (what the catalogue's representative set groups by)
    name: str = field(default="", compare=False, repr=False)
    template_args: tuple = field(default=(), compare=False, repr=False)
    #: blocks a thread-block cluster (the kernel's CLUSTER; a grid is a multiple)
    cluster: int = 1


@dataclass(frozen=True)
class KernelDecl:
    family: str
    name: str
    template: tuple[str, ...]  # template parameter names, in order
    args: tuple[tuple[str, str], ...]  # (name, kind) of each argument, in order

    def expression(self, *targs) -> str:
        if len(targs) != len(self.template):
            raise TypeError(f"{self.name} takes {len(self.template)} template arguments, got {len(targs)}")
        return f"cunorm::{self.name}<{', '.join(_format(a) for a in targs)}>"

    def __call__(self, *targs, cooperative: bool = False, persistent: bool = False) -> Kernel:
        """The instantiation for these template arguments (a CLUSTER over 1,
        thread-block clusters, needs sm_90: min_arch)."""
        params = dict(zip(self.template, targs))
        cluster = params.get("CLUSTER", 1)
        min_arch = 90 if cluster > 1 else 0
        data = params.get("T", params.get("A"))
        acc = "f64" if data == "double" else "f32"
        signature = tuple((n, acc if k == "acc" else k) for n, k in self.args)
        return Kernel(self.family, self.expression(*targs), cooperative, persistent, min_arch, signature, self.name,
                      tuple(targs), cluster)


@dataclass(frozen=True)
class Stage:
    """A load or store stage (cunorm/kernels/stages.cuh) as a template
    argument: its name and its own template arguments."""

    name: str
    args: tuple = ()

    @property
    def expression(self) -> str:
        if not self.args:
            return f"cunorm::{self.name}"
        return f"cunorm::{self.name}<{', '.join(_format(a) for a in self.args)}>"


def affine_store(params: str, flags: int, out: str) -> Stage:
    """y = act((x - center) * scale [* w] [+ b]) rounded to ``out``; w and b
    stored as ``params`` (``flags``: the store's FLAGS word, plans.py)."""
    return Stage("AffineStore", (params, flags, out))


def quant_store(params: str, flags: int, quantized: str, scaling: int, group: int = 0) -> Stage:
    """affine_store's value divided by a scale and rounded into the one-byte
    type ``quantized`` (cunorm::e4m3_t, cunorm::e5m2_t or signed char);
    ``scaling``: the caller's scale (0), the row's (1), the row's under the
    caller's bound (2); ``group``: elements a dynamic scale covers (0: the
    row)."""
    return Stage("QuantStore", (params, flags, quantized, scaling, group))


#: no y: the statistics alone
NO_STORE = Stage("NoStore")


def row_load(data: str, residual: bool, gate: str | None = None, wide: str | None = None) -> Stage:
    """x, or h = x + r formed and written out (``residual``), or h = r + g *
    x with g stored as ``gate`` (a storage type name), or h = x + r with r
    and h stored as ``wide`` (the float32 residual stream)."""
    if wide is not None:
        return Stage("WideResidualLoad", (data, wide))
    if gate is not None:
        return Stage("ScaledResidualLoad", (data, gate))
    return Stage("ResidualLoad" if residual else "XLoad", (data,))


def _format(value) -> str:
    if isinstance(value, Stage):
        return value.expression
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.replace("::", "").replace("_", "").replace("<", "").replace(
            ">", "").replace(",", "").replace(" ", "").isalnum():
        return value
    raise TypeError(f"template argument {value!r} is not a type name, bool or int cunorm formats")


def _args(spec: str) -> tuple[tuple[str, str], ...]:
    """'x r:in y:out rows:i64 ...': names, each group ended by its kind."""
    out, names = [], []
    for word in spec.split():
        name, _, kind = word.partition(":")
        names.append(name)
        if kind:
            assert kind in KINDS, kind
            out += [(n, kind) for n in names]
            names = []
    assert not names, spec
    return tuple(out)


_ROW_ARGS = "x r w b:in y h center_out scale_out:out"
_NORM_ROWS = ("NormT", "T", "STORE", "LOAD", "VEC")
_CHANNEL_DIMS = "batch spatial:i64 channels channels_per_group"

# rows.cu
ROWS_CACHED = KernelDecl("rows", "rows_cached", _NORM_ROWS + ("VECS_PER_THREAD", "BLOCK_PER_ROW"),
                         _args("x r w b quant_scale shift mod_scale res_gate gate:in y h center_out scale_out y_scale "
                               "y_plain:out rows:i64 n:i32 x_row_stride:i64 eps:acc threads_per_row:i32 "
                               "scale_row_stride scale_group_stride param_rows mod_div mod_count:i64"))
# rows_streamed.cu
ROWS_UNCACHED = KernelDecl("rows_streamed", "rows_uncached", _NORM_ROWS,
                           _args("x r w b quant_scale:in y h center_out scale_out y_scale y_plain:out rows n "
                                 "x_row_stride:i64 eps:acc stash_vecs scale_row_stride scale_group_stride:i64"))
ROWS_SPLIT_PARTIAL = KernelDecl("rows_streamed", "rows_split_partial", ("NormT", "T", "LOAD", "VEC"),
                                _args("x r:in h partial:out rows n x_row_stride chunks:i64"))
ROWS_SPLIT_FINALIZE = KernelDecl("rows_streamed", "rows_split_finalize", ("NormT", "T", "LOAD"),
                                 _args("x h partial:in affine center_out scale_out:out rows n x_row_stride chunks:i64 "
                                       "eps:acc"))
ROWS_SPLIT_APPLY = KernelDecl("rows_streamed", "rows_split_apply", _NORM_ROWS,
                              _args("x h w b partial:in y center_out scale_out:out rows n x_row_stride chunks:i64 "
                                    "eps:acc"))
ROWS_SPLIT_APPLY_TILES = KernelDecl("rows_streamed", "rows_split_apply_tiles", ("T", "STORE", "LOAD", "VEC"),
                                    _args("x h w b affine:in y:out rows n x_row_stride tile_vecs tiles:i64"))
ROWS_RESIDENT = KernelDecl("rows_streamed", "rows_resident", _NORM_ROWS,
                           _args(f"{_ROW_ARGS} partial arrived:out rows n x_row_stride chunk_vecs:i64 eps:acc"))
# strided.cu
STRIDED_NORM = KernelDecl("strided", "strided_norm", ("NormT", "T", "STORE", "VEC", "CHANNELS_PER_THREAD"),
                          _args("x w b:in y center_out scale_out:out outer:i64 reduced:i32 inner x_outer_stride "
                                "x_reduced_stride:i64 eps:acc block_x:i32"))
RESIDUAL_ADD = KernelDecl("strided", "residual_add", ("T", "VEC"), _args("x r:in h:out n_vec:i64"))
# channels.cu
CHANNEL_PARTIAL = KernelDecl("channels", "channel_partial", ("NormT", "T", "VEC", "LAYOUT"),
                             _args(f"x:in partial:out {_CHANNEL_DIMS} per_sample:i32 chunks chunk_len:i64 "
                                   f"block_x:i32"))
CHANNEL_FINALIZE = KernelDecl("channels", "channel_finalize", ("NormT", "T", "LAYOUT"),
                              _args(f"x partial:in running_mean running_var:io affine mean_out rstd_out:out "
                                    f"{_CHANNEL_DIMS} per_sample:i32 chunks:i64 eps momentum:acc block_x:i32"))
CHANNEL_FROM_RUNNING = KernelDecl("channels", "channel_from_running", ("A",),
                                  _args("running_mean running_var:in affine mean_out rstd_out:out channels:i32 "
                                        "eps:acc"))
CHANNEL_APPLY = KernelDecl("channels", "channel_apply", ("T", "STORE", "VEC", "LAYOUT"),
                           _args(f"x w b affine running_mean running_var partial:in y mean_out rstd_out:out "
                                 f"{_CHANNEL_DIMS} per_sample:i32 chunks chunk_len:i64 eps:acc hints block_x:i32"))
CHANNEL_STREAM = KernelDecl("channel_stream", "channel_stream", ("NormT", "T", "STORE", "VEC"),
                            _args("x w b:in y partial affine mean_out rstd_out sync:out groups_total group_vecs "
                                  "spatial_vecs:i64 channels_per_group groups:i32 tile_vecs row_tiles slab_tiles "
                                  "lag_slabs:i64 hints:i32 eps:acc"))
# onchip.cu
CHANNEL_ONCHIP = KernelDecl("onchip", "channel_onchip",
                            ("T", "STORE", "VEC", "CHANNELS_LAST", "THREADS", "ITEMS", "CLUSTER"),
                            _args("x w b:in running_mean running_var:io y mean_out rstd_out:out rows row_vecs:i32 "
                                  "row_stride sample_stride group_stride:i64 spatial_vecs channels_per_group "
                                  "groups:i32 eps momentum:acc"))
CHANNEL_GRAD_ONCHIP = KernelDecl("onchip", "channel_grad_onchip",
                                 ("T", "P", "FLAGS", "VEC", "TRAINING", "THREADS", "ITEMS", "CLUSTER"),
                                 _args("dy x mean rstd w:in dx dw db:out batch plane_vecs channels:i32"))
# backward.cu
_ROWS_GRAD_CLUSTER_ARGS = _args("dy x dh w center scale:in dx partial:out rows:i64 n row_threads:i32 eps:acc "
                                "prefetch_next:i32 dw db arrived:out")
ROWS_GRAD_CACHED = KernelDecl("backward", "rows_grad_cached",
                              ("Grad", "T", "P", "FLAGS", "VEC", "VPT", "MAX_THREADS", "MIN_BLOCKS", "MULTI_ROW"),
                              _ROWS_GRAD_CLUSTER_ARGS + _args("heads:i32"))
ROWS_GRAD_GATED = KernelDecl("backward", "rows_grad_gated",
                             ("Grad", "T", "P", "FLAGS", "GATE", "VEC", "VPT", "MAX_THREADS", "MIN_BLOCKS", "MULTI_ROW"),
                             _args("dy x z w scale:in dx dz partial:out rows:i64 n row_threads:i32 eps:acc "
                                   "prefetch_next:i32 dw arrived:out heads:i32"))
ROWS_GRAD_WIDE = KernelDecl("backward", "rows_grad_wide",
                            ("Grad", "T", "P", "FLAGS", "VEC", "VPT", "MAX_THREADS", "MIN_BLOCKS", "MULTI_ROW"),
                            _args("dy x dh w center scale:in dx dres partial:out rows:i64 n row_threads:i32 eps:acc "
                                  "prefetch_next:i32 dw db arrived:out heads:i32"))
ROWS_GRAD_CLUSTER = KernelDecl("backward", "rows_grad_cluster",
                               ("Grad", "T", "P", "FLAGS", "VEC", "VPT", "MAX_THREADS", "MIN_BLOCKS", "CLUSTER"),
                               _ROWS_GRAD_CLUSTER_ARGS)
COLUMN_SUM = KernelDecl("backward", "column_sum", ("A", "P", "C"),
                        _args("partial:in out_w out_b:out parts:i32 n:i64 block_x:i32"))
# backward_streamed.cu
ROWS_GRAD_CHUNKS = KernelDecl("backward_streamed", "rows_grad_chunks", ("Grad", "T", "P", "FLAGS", "VEC"),
                              _args("dy x w center scale:in stat_partial:out rows n chunks chunk_len:i64"))
ROWS_GRAD_SUMS = KernelDecl("backward_streamed", "rows_grad_sums", ("Grad", "T", "P", "FLAGS", "VEC"),
                            _args("dy x w center scale:in partial:out outer reduced inner chunks chunk_len:i64"))
ROWS_GRAD_FINALIZE = KernelDecl("backward_streamed", "rows_grad_finalize", ("Grad", "A"),
                                _args("partial center scale:in coeffs:out groups chunks n:i64 eps:acc"))
ROWS_GRAD_FINALIZE_WIDE = KernelDecl("backward_streamed", "rows_grad_finalize_wide", ("Grad", "A"),
                                     _args("partial center scale:in coeffs:out chunks n:i64 eps:acc"))
ROWS_GRAD_APPLY = KernelDecl("backward_streamed", "rows_grad_apply", ("Grad", "T", "P", "FLAGS", "VEC", "STRIDED"),
                             _args("dy x dh w coeffs:in dx partial dw db:out outer reduced inner chunks "
                                   "chunk_len:i64"))
# strided_grads.cu
STRIDED_GRAD_CACHED = KernelDecl("strided_grads", "strided_grad_cached", ("Grad", "T", "P", "FLAGS", "VEC", "CPT"),
                                 _args("dy x dh w center scale:in dx partial:out outer:i64 reduced:i32 inner:i64 "
                                       "eps:acc block_x:i32"))
# modulated_grads.cu
ROWS_GRAD_MODULATED = KernelDecl("modulated_grads", "rows_grad_modulated",
                                 ("Grad", "T", "P", "FLAGS", "MODF", "VEC", "VPT", "MAX_THREADS", "MIN_BLOCKS"),
                                 _args("dy h x dh w mod_scale res_gate center rstd:in dx dres partial:out rows:i64 "
                                       "n:i32 mod_div mod_count:i64 units_per_run unit_rows:i32 eps:acc"))
MODULATED_GRAD_SUMS = KernelDecl("modulated_grads", "modulated_grad_sums", ("A", "P", "FLAGS", "MODF", "OUTS", "C"),
                                 _args("partial w b mod_scale:in dshift dscale dgate weighted:out units:i64 n "
                                       "units_per_run:i32 runs mod_count:i64 block_x:i32"))
# channel_grads.cu
CHANNEL_GRAD_SUMS = KernelDecl("channel_grads", "channel_grad_sums", ("T", "VEC", "LAST"),
                               _args(f"dy x mean:in partial:out {_CHANNEL_DIMS} stat_batch:i32 chunks chunk_len:i64 "
                                     f"block_x:i32"))
CHANNEL_GRAD_COMBINE = KernelDecl("channel_grads", "channel_grad_combine", ("A",),
                                  _args("partial:in sums:out members chunks:i64"))
CHANNEL_GRAD_FINALIZE = KernelDecl("channel_grads", "channel_grad_finalize", ("A", "P", "FLAGS", "TRAINING"),
                                   _args(f"sums mean rstd w count_at:in coeffs dw db totals:out {_CHANNEL_DIMS} "
                                         f"stat_batch:i32 sums_batch:i64 count:acc"))
CHANNEL_GRAD_APPLY = KernelDecl("channel_grads", "channel_grad_apply", ("T", "VEC", "LAST"),
                                _args(f"dy x mean coeffs:in dx:out {_CHANNEL_DIMS} stat_batch:i32 chunks chunk_len:i64 "
                                      f"block_x:i32"))

# sync.cu
CHANNEL_SYNC_COMBINE = KernelDecl("sync", "channel_sync_combine", ("A",),
                                  _args("gathered:in running_mean running_var:io mean var rstd count:out "
                                        "ranks channels:i32 eps momentum:acc"))
CHANNEL_SYNC_COUNT = KernelDecl("sync", "channel_sync_count", ("A",), _args("count:out channels:i32 value:acc"))

DECLARATIONS = tuple(v for v in dict(globals()).values() if isinstance(v, KernelDecl))
