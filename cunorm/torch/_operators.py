"""cunorm's registered torch operators (``torch.ops.cunorm.*``), built from
the table of ops (cunorm/_engine/ops.py): for each operator there, its
schema (the table's arguments in order, typed by TORCH_TYPES), its
implementation, its fake implementation (each output's shape, dtype and
strides, which inductor trusts) and, for the forward operators, the
autograd formula that calls the backward operator.

The implementations call the engine (cunorm/_engine/calls.py) on the
tensors: the launch cache, else the general path, never routed again.
Each forward operator returns a list (y, then h, then the statistics, then
BatchNorm's updated running buffers) so one operator serves every return
form; the Lp family's return y alone. BatchNorm's operator is functional
(autograd is registered on functional operators only): in training it
updates copies of the running buffers and returns them, and its caller
writes them back (cunorm/torch/_functions.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._engine import calls, channel_norms, conditioning, dispatch_rows, modulated_grad, ops, plans, row_norms
from .._engine.ops import ARGUMENTS, OPS, Op, Operator
from .._interop import torch as _adapter
from ._autograd import offset_weight
from ._library import define

#: each argument kind of the table (ARGUMENTS) as a schema type
TORCH_TYPES = {"array": "Tensor", "optional array": "Tensor?", "ints": "SymInt[]", "float": "float", "bool": "bool",
               "int": "SymInt", "name": "str"}


def schema(operator: Operator) -> str:
    """The operator's schema, from the table."""
    arguments = ", ".join(f"{TORCH_TYPES[ARGUMENTS[name]]} {name}" for name in operator.arguments)
    return f"({arguments}) -> {'Tensor' if operator.single else 'Tensor[]'}"


def operator_axes(axis) -> list[int]:
    """An operator's ``axes`` of a public call's ``axis`` (None: every
    axis, empty)."""
    if axis is None:
        return []
    if isinstance(axis, (tuple, list)):
        return [row_norms.check_int(a, "axis") for a in axis]
    return [row_norms.check_int(axis, "axis")]


def unfused_form(x, weight, bias, residual, axis, epilogue, shift, scale, residual_gate) -> str | None:
    """What in a conditioned call without a gate (whose form has a backward
    of its own) the fused modulated backward does not take, by looking at
    no size (a traced size may be symbolic); None where it may take it
    (modulated_fusable then asks of the shapes)."""
    if conditioning.per_head(weight, axis) or conditioning.per_head(bias, axis):
        return "per-head weights"
    if conditioning.wide(x, residual):
        return "a float32 residual under 16-bit x"
    if epilogue & plans.UNFUSED_IN_BACKWARD:
        return "an activation or a weight offset"
    if shift is None and scale is None and residual_gate is None:
        return "none of shift=, scale= or residual_gate="
    return None


def axes_span(axis, ndim: int) -> tuple[int, int]:
    """plans.normalize_axes for front-end code that dynamo traces: its memo
    is a functools.lru_cache, which dynamo traces through with a warning,
    so a traced call takes the span without it (traced once; eager calls
    keep the memo)."""
    return plans.normalize_axes(axis, ndim, memo=not torch.compiler.is_compiling())


def modulated_fusable(norm, x, weight, bias, residual, axis, epilogue, shift, scale, residual_gate) -> bool:
    """Whether the fused modulated backward (modulated_grad.fusable) takes
    a call on torch tensors (CUDA, or meta: the operators' fakes give their
    shapes)."""
    arrays = [a for a in (shift, scale, residual_gate) if a is not None]
    if (not isinstance(x, Tensor) or x.device.type not in ("cuda", "meta")
            or not all(isinstance(a, Tensor) for a in arrays)
            or unfused_form(x, weight, bias, residual, axis, epilogue, shift, scale, residual_gate) is not None):
        return False
    first, last = axes_span(axis, x.dim())
    return modulated_grad.fusable(tuple(x.shape), x.element_size(), first, last, [tuple(a.shape) for a in arrays],
                                  False, residual_gate is not None)


def _as_list(results) -> list[Tensor]:
    return list(results) if isinstance(results, tuple) else [results]


def _present(*tensors) -> list[Tensor]:
    return [t for t in tensors if t is not None]


def _axis(axes, op: Op):
    """The engine's axis of an operator's ``axes``: empty is every axis
    for the Lp family (axis=None), else as given."""
    return tuple(axes) if axes or op.statistics else None


def _stats_like(x: Tensor, shape) -> Tensor:
    """An empty statistics tensor: the accumulation dtype of x's dtype."""
    return x.new_empty(shape, dtype=_adapter.ACCUMULATION[x.dtype])


# -- implementations ------------------------------------------------------------------------------------------------

def _conditioned(op: Op, a: dict) -> dict | None:
    """The per-row operands among a forward operator's arguments (None for
    the plain operators)."""
    return {name: a[name] for name in op.conditioned if name in a} or None


def _forward(op: Op, a: dict):
    """A forward operator's implementation, its arguments by name."""
    x = a["x"]
    if op.family == "rows":
        norm = op.norm
        if "norm" in a:
            norm = a["norm"]
            dispatch_rows.norm_info(norm)  # (a caller's string: checked first, never pasted into a kernel name)
        results = _as_list(calls.rows(norm, x, a.get("weight"), a.get("bias"), a.get("residual"), _axis(a["axes"], op),
                                      a["eps"], a.get("return_stats", False), None, None,
                                      epilogue=a.get("epilogue", 0), conditioned=_conditioned(op, a)))
        return results[0] if op.forward.single else results
    training = a.get("training", True)
    running = [a.get("running_mean"), a.get("running_var")]
    if training and op.running:  # (copies: the operator is functional)
        running = [None if b is None else b.clone() for b in running]
    results = _as_list(calls.channels(op.norm, x, a.get("num_groups"), a.get("weight"), a.get("bias"), *running,
                                      training, a.get("momentum", 0.1), a["eps"], a["channel_axis"],
                                      a["return_stats"], None, epilogue=a["epilogue"]))
    return results + ([b for b in running if b is not None] if training and op.running else [])


def _backward(op: Op, a: dict):
    """A backward operator's implementation, its arguments by name:
    [dx, dweight?, dbias?] (dx alone for the Lp family)."""
    if op.family == "rows" and "norm_before_gate" in a:  # the gated backward: [dx, dgate, dweight?]
        g = calls.rows_grad_gated(a["dy"], a["x"], a["rstd"], a.get("weight"), a["gate"], a["norm_before_gate"],
                                  _axis(a["axes"], op))
        return [g.x, g.gate] + _present(g.weight)
    if op.family == "rows" and "gated_x" in a:  # the modulated backward
        g = calls.rows_grad_modulated(op.norm, a["dy"], a["x"], a.get("mean"), a["rstd"], a.get("weight"),
                                      a.get("bias"), a["dh"], a["shift"], a["scale"], a["residual_gate"],
                                      a["gated_x"], _axis(a["axes"], op))
        return [g.x] + _present(g.residual, g.weight, g.bias, g.shift, g.scale, g.residual_gate)
    if op.family == "rows":
        norm = a.get("norm", op.norm)
        results = calls.rows_grad(norm, a["dy"], a["x"], a.get("mean"), a.get("rstd"), a.get("weight"), a.get("bias"),
                                  a.get("dh"), _axis(a["axes"], op), a.get("eps", 0.0), None)
        if op.backward.single:
            return results
        dx, *grads = results
        return [dx] + _present(*grads)
    norm = a["norm"]  # (a caller's string: the engine refuses one it does not know)
    takes_groups = getattr(ops.BY_NORM.get(norm), "groups", False)
    groups = a["num_groups"] if takes_groups else None
    dx, dw, db = calls.channel_grad(norm, a["dy"], a["x"], a["mean"], a["rstd"], groups, a.get("weight"), a.get("bias"),
                                    a["channel_axis"], a["training"], a["eps"], None)
    return [dx] + _present(dw, db)


# -- fakes -----------------------------------------------------------------------------------------------------------

def _channel_y(norm: str, x: Tensor, channel_axis: int) -> Tensor:
    """y of a channel norm as the launch makes it: x's memory layout."""
    ndim, axis = x.dim(), channel_axis % x.dim()
    per_sample = getattr(ops.BY_NORM.get(norm), "per_sample", True)
    order = channel_norms.output_order(tuple(x.shape), tuple(x.stride()), axis, per_sample)
    return x.new_empty([x.shape[a] for a in order]).permute(*[order.index(a) for a in range(ndim)])


def _forward_fake(op: Op, a: dict):
    x = a["x"]
    if op.family == "rows":
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        if op.forward.single:
            return y
        outputs = [y]
        if a.get("residual") is not None:  # (h in the residual's dtype: float32 for the float32 stream)
            outputs.append(x.new_empty(x.shape, dtype=a["residual"].dtype))
        if a["return_stats"]:
            axes = a["axes"]
            shape = row_norms.stats_shape(tuple(x.shape), *row_norms.axis_span(tuple(axes) if axes else None, x.dim()))
            outputs += [_stats_like(x, shape) for _ in op.statistics]
        return outputs
    outputs = [_channel_y(op.norm, x, a["channel_axis"])]
    if a["return_stats"]:
        shape = channel_norms.stats_shape(op.norm, tuple(x.shape), a["channel_axis"] % x.dim(), a.get("num_groups"))
        outputs += [_stats_like(x, shape) for _ in op.statistics]
    if op.running and a["training"]:
        outputs += [torch.empty_like(b) for b in (a["running_mean"], a["running_var"]) if b is not None]
    return outputs


def _wide_backward(op: Op, a: dict):
    """The float32 residual stream's backward operator: [dx, dresidual,
    dweight?, dbias?]."""
    g = calls.rows_grad_wide(op.norm, a["dy"], a["x"], a.get("mean"), a["rstd"], a.get("weight"), a.get("bias"),
                             a["dh"], _axis(a["axes"], op))
    return [g.x, g.residual] + _present(g.weight, g.bias)


def _wide_backward_fake(op: Op, a: dict):
    """dx C-contiguous in dy's dtype, dresidual in h's float32, the
    parameters' gradients in their own."""
    h = a["x"]
    dx = torch.empty(h.shape, dtype=a["dy"].dtype, device=h.device)
    return [dx, torch.empty_like(h, memory_format=torch.contiguous_format)] + [
        p.new_empty(p.shape) for p in _present(a.get("weight"), a.get("bias"))]


def _backward_fake(op: Op, a: dict):
    x = a["x"]
    if op.family == "rows":
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        dx = _channel_y(a["norm"], x, a["channel_axis"])
    if op.backward.single:
        return dx
    if "norm_before_gate" in a:  # the gated backward: dgate like dx, dweight C-contiguous in its own dtype
        return [dx, torch.empty_like(dx)] + [w.new_empty(w.shape) for w in _present(a.get("weight"))]
    if "gated_x" in a:  # the modulated backward: each gradient C-contiguous in its array's shape and dtype
        dres = [torch.empty_like(dx)] if a["residual_gate"] is not None else []
        arrays = _present(*(a.get(name) for name in op.params + ("shift", "scale", "residual_gate")))
        return [dx] + dres + [p.new_empty(p.shape) for p in arrays]
    return [dx] + [torch.empty_like(p) for p in _present(*(a.get(name) for name in op.params))]


# -- autograd -------------------------------------------------------------------------------------------------------
# The forward operators return their statistics whenever autograd needs
# them (cunorm.torch's functions and layers ask for them and drop them
# again); the statistics outputs are not differentiated through. The
# epilogue's bits the backward operators do not differentiate
# (plans.UNFUSED_IN_BACKWARD) run as torch ops around the norm where
# autograd records (cunorm/torch/_functions.py), and a backward through
# an operator called with them raises.

_UNFUSED = ("cunorm.{op}: the operator was called with an activation or a weight offset (epilogue={bits}) while "
            "autograd recorded it; its backward does not differentiate them. Call it through cunorm.torch.{op} "
            "(or cunorm.{op}), which runs them as torch ops where autograd records.")

_NO_STATS = ("cunorm.{op}: the operator was called with return_stats=False while autograd recorded it, so the "
             "statistics its backward needs were not kept. Call it through cunorm.torch.{op} (or cunorm.{op}), "
             "which asks for them, or pass return_stats=True.")


def _output_grads(grads) -> list:
    """The gradients of a list-returning operator's outputs, in order."""
    return list(grads[0]) if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else list(grads)


def _setup(op: Op, operators: tuple, ctx, a: dict, output) -> None:
    """What the backward needs: for the normalizing ops with statistics,
    the normalized input (h where the forward formed it), the parameters
    and the statistics (BatchNorm in eval: its running buffers), with the
    modulation arrays and the x residual_gate scaled for the conditioned
    operator (x, the weight, the gate z and rstd for its gated form); for
    the Lp family, x."""
    ctx.arguments, ctx.backward = operators[0].arguments, operators[1]
    if not op.statistics:
        ctx.save_for_backward(a["x"])
        ctx.norm, ctx.axes, ctx.eps = a["norm"], a["axes"], a["eps"]
        return
    ctx.gated = a.get("gate") is not None
    # (the gated backward takes the weight offset: its formula passes 1 + w)
    ctx.unfused = a["epilogue"] & (plans.ACTIVATION_BITS if ctx.gated else plans.UNFUSED_IN_BACKWARD)
    training = a.get("training", True)
    ctx.kept = a["return_stats"] or not training
    ctx.residual = a.get("residual") is not None
    ctx.composed, ctx.wide, ctx.dtype = None, False, a["x"].dtype
    if not ctx.kept:
        return
    if ctx.gated:
        ctx.backward, ctx.axes = op.gated_backward, a["axes"]
        ctx.before = not a["epilogue"] & plans.FLAG_GATE_INPUT
        ctx.offset = bool(a["epilogue"] & plans.FLAG_WEIGHT_OFFSET)
        ctx.save_for_backward(a["x"], a.get("weight"), a["gate"], output[-1])
        return
    if op.family == "rows":
        h = output[1] if ctx.residual else a["x"]
        ctx.wide = ctx.residual and h.dtype != a["x"].dtype  # (the float32 residual stream)
        if ctx.wide:
            ctx.backward = op.wide_backward
        conditioned = [a[name] for name in ("shift", "scale", "residual_gate") if name in a]
        if conditioned:
            # (the pattern of the arrays is not looked at: the backward's ValueError names one it does not take)
            ctx.composed = unfused_form(a["x"], a.get("weight"), a.get("bias"), a.get("residual"),
                                        _axis(a["axes"], op), a["epilogue"], a["shift"], a["scale"],
                                        a["residual_gate"])
            conditioned.append(a["x"] if a["residual_gate"] is not None else None)
        ctx.save_for_backward(h, a.get("weight"), a.get("bias"), *conditioned, *output[-len(op.statistics):])
        ctx.axes = a["axes"]
        return
    statistics = (output[1], output[2]) if training else (a["running_mean"], a["running_var"])
    ctx.save_for_backward(a["x"], *statistics, a.get("weight"), a.get("bias"))
    ctx.num_groups, ctx.channel_axis, ctx.training = a.get("num_groups") or 0, a["channel_axis"], training
    ctx.eps = a["eps"] if op.running else 0.0


_NOT_FUSED = ("cunorm.{op}_conditioned: the operator was called while autograd recorded it with {what}, which its "
              "backward (the fused {form} backward) does not take. Call it through cunorm.torch.{op} (or "
              "cunorm.{op}), which composes the norm and torch's ops where autograd records.")


def _gated_gradients(ctx, grads, backward) -> dict:
    """The gated form's gradients by argument name: x, the weight (of the
    weight the caller gave, 1 + w's where the forward offset it) and the
    gate z."""
    x, weight, gate, rstd = ctx.saved_tensors
    dy = grads[0] if grads[0] is not None else torch.zeros_like(x)
    w = offset_weight(x, weight) if weight is not None and ctx.offset else weight
    dx, dgate, *dweight = backward(dy, x, rstd, w, gate, ctx.before, ctx.axes)
    return {"x": dx, "gate": dgate, "weight": dweight[0].to(weight.dtype) if dweight else None}


def _gradients(op: Op, ctx, grads) -> tuple:
    """The gradients of the forward operator's arguments, in order: dx for
    x (and for the residual), dweight and dbias (the modulation arrays'
    for the conditioned operator); None for the rest."""
    backward = getattr(torch.ops.cunorm, ctx.backward.name)
    forward_arguments = ctx.arguments
    if not op.statistics:
        (x,) = ctx.saved_tensors
        found = {"x": backward(grads[0], x, ctx.norm, ctx.axes, ctx.eps)}
        return tuple(found.get(name) for name in forward_arguments)
    if ctx.unfused:
        raise RuntimeError(_UNFUSED.format(op=op.name, bits=ctx.unfused))
    if not ctx.kept:
        raise RuntimeError(_NO_STATS.format(op=op.name))
    if ctx.composed:
        raise RuntimeError(_NOT_FUSED.format(op=op.name, what=ctx.composed, form="gated" if ctx.gated else "modulated"))
    grads = _output_grads(grads)
    if ctx.gated:
        found = _gated_gradients(ctx, grads, backward)
        return tuple(found.get(name) for name in forward_arguments)
    if op.family == "rows":
        h, weight, bias, *rest = ctx.saved_tensors
        modulated = "gated_x" in ctx.backward.arguments
        shift = scale = residual_gate = gated_x = None
        if modulated:
            shift, scale, residual_gate, gated_x, *rest = rest
        dy = grads[0] if grads[0] is not None else torch.zeros_like(h, dtype=ctx.dtype)
        values = dict(zip(op.statistics, rest), dy=dy, x=h, weight=weight, bias=bias,
                      dh=grads[1] if ctx.residual else None, shift=shift, scale=scale, residual_gate=residual_gate,
                      gated_x=gated_x, axes=ctx.axes)
        results = backward(*(values[name] for name in ctx.backward.arguments))
        dres = results[1] if residual_gate is not None or ctx.wide else None
        rest = iter(results[1 + (dres is not None):])
        found = {"x": results[0], "residual": dres if dres is not None else (results[0] if ctx.residual else None)}
        for name, given in (("weight", weight), ("bias", bias), ("shift", shift), ("scale", scale),
                            ("residual_gate", residual_gate)):
            if given is not None:  # (the backward returns a gradient for each array given, in this order)
                found[name] = next(rest)
        return tuple(found.get(name) for name in forward_arguments)
    x, mean, rstd, weight, bias = ctx.saved_tensors
    dy = grads[0] if grads[0] is not None else torch.zeros_like(x)
    results = backward(dy, x, mean, rstd, op.norm, ctx.num_groups, weight, bias, ctx.training, ctx.eps,
                       ctx.channel_axis)
    rest = iter(results[1:])
    found = {"x": results[0], "weight": next(rest) if weight is not None else None,
             "bias": next(rest) if "bias" in op.params and bias is not None else None}
    return tuple(found.get(name) for name in forward_arguments)


# -- registration ---------------------------------------------------------------------------------------------------

def _by_name(operator: Operator, fn):
    """fn(a) as a function of the operator's arguments in order."""
    names = operator.arguments

    def call(*args, **kwargs):
        a = dict(zip(names, args))
        a.update(kwargs)
        return fn(a)

    return call


def _register() -> None:
    """Every operator of the table, defined once (cunorm/torch/_library.py);
    the forward ones with their autograd formula."""
    registered = set()

    def register(op: Op, operator: Operator, impl, fake, pair=None) -> None:
        if operator.name in registered:
            return
        formula = ()
        if pair is not None and operator is pair[0]:  # (a forward operator: its autograd formula)
            formula = (lambda ctx, *grads: _gradients(op, ctx, grads),
                       lambda ctx, inputs, output: _setup(op, pair, ctx, dict(zip(pair[0].arguments, inputs)), output))
        define(operator.name, schema(operator), _by_name(operator, lambda a, f=impl: f(op, a)),
               _by_name(operator, lambda a, f=fake: f(op, a)), *formula)
        registered.add(operator.name)

    for op in OPS.values():
        if op.gated_backward is not None:
            register(op, op.gated_backward, _backward, _backward_fake)
        if op.wide_backward is not None:
            register(op, op.wide_backward, _wide_backward, _wide_backward_fake)
        for pair in op.pairs:
            for operator, impl, fake in zip(pair, (_forward, _backward), (_forward_fake, _backward_fake)):
                register(op, operator, impl, fake, pair)


_register()
