"""The table of ops (cunorm/_engine/ops.py) against the surfaces built on
it: the public functions' signatures, cunorm.torch's registered operators
(schemas, and the fakes' outputs on meta tensors against the NumPy
reference's), cunorm.jax's functions. No GPU needed."""
import inspect

import numpy as np
import pytest

import cunorm
from cunorm._engine import ops

#: the operators' schemas, as compiled graphs and saved programs name them:
#: a change here breaks them
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor? weight, Tensor? residual, SymInt[] axes, float eps, bool return_stats, "
                "SymInt epilogue) -> Tensor[]",
    "layer_norm": "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, SymInt[] axes, float eps, "
                  "bool return_stats, SymInt epilogue) -> Tensor[]",
    "normalize": "(Tensor x, str norm, SymInt[] axes, float eps) -> Tensor",
    "group_norm": "(Tensor x, SymInt num_groups, Tensor? weight, Tensor? bias, float eps, SymInt channel_axis, "
                  "bool return_stats, SymInt epilogue) -> Tensor[]",
    "instance_norm": "(Tensor x, Tensor? weight, Tensor? bias, float eps, SymInt channel_axis, bool return_stats, "
                     "SymInt epilogue) -> Tensor[]",
    "batch_norm": "(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, bool training, "
                  "float momentum, float eps, SymInt channel_axis, bool return_stats, SymInt epilogue) -> Tensor[]",
    "rms_norm_backward": "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight, Tensor? dh, SymInt[] axes) -> Tensor[]",
    "layer_norm_backward": "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, Tensor? dh, "
                           "SymInt[] axes) -> Tensor[]",
    "normalize_backward": "(Tensor dy, Tensor x, str norm, SymInt[] axes, float eps) -> Tensor",
    "channel_norm_backward": "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, str norm, SymInt num_groups, "
                             "Tensor? weight, Tensor? bias, bool training, float eps, SymInt channel_axis) -> Tensor[]",
    "rms_norm_conditioned": "(Tensor x, Tensor? weight, Tensor? residual, Tensor? shift, Tensor? scale, "
                            "Tensor? residual_gate, Tensor? gate, SymInt[] axes, float eps, bool return_stats, "
                            "SymInt epilogue) -> Tensor[]",
    "layer_norm_conditioned": "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? shift, "
                              "Tensor? scale, Tensor? residual_gate, SymInt[] axes, float eps, bool return_stats, "
                              "SymInt epilogue) -> Tensor[]",
    "rms_norm_modulated_backward": "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight, Tensor? dh, Tensor? shift, "
                                   "Tensor? scale, Tensor? residual_gate, Tensor? gated_x, SymInt[] axes) -> Tensor[]",
    "rms_norm_gated_backward": "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight, Tensor? gate, "
                               "bool norm_before_gate, SymInt[] axes) -> Tensor[]",
    "layer_norm_modulated_backward": "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, "
                                     "Tensor? dh, Tensor? shift, Tensor? scale, Tensor? residual_gate, "
                                     "Tensor? gated_x, SymInt[] axes) -> Tensor[]",
    "rms_norm_float32_residual_backward": "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight, Tensor? dh, "
                                          "SymInt[] axes) -> Tensor[]",
    "layer_norm_float32_residual_backward": "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, "
                                            "Tensor? bias, Tensor? dh, SymInt[] axes) -> Tensor[]",
}


def test_every_operator_is_described():
    assert set(ops.operators()) == set(SCHEMAS)
    for operator in ops.operators().values():
        assert set(operator.arguments) <= set(ops.ARGUMENTS), operator.name


@pytest.mark.parametrize("op", ops.OPS.values(), ids=list(ops.OPS))
def test_public_signatures_follow_the_table(op):
    """What each public function takes is what the table says the op takes:
    its parameters, a residual, the running buffers, the statistics, the
    epilogue's options, the default eps."""
    for fn in (getattr(cunorm, op.name),) + ((getattr(cunorm.reference, op.name),)):
        params = inspect.signature(fn).parameters
        for name in op.params:
            assert name in params, (fn, name)
        assert ("residual" in params) == op.residual, fn
        assert ("running_mean" in params and "running_var" in params) == op.running, fn
        assert ("return_stats" in params) == bool(op.statistics), fn
        for option in ("weight_offset", "rounding", "activation"):
            assert (option in params) == (option in op.options), (fn, option)
        assert params["eps"].default == op.eps, fn
    backward = inspect.signature(getattr(cunorm, f"{op.name}_backward")).parameters
    for name in op.params + op.statistics:
        assert name in backward, (op.name, name)


def test_the_statistics_are_what_the_reference_returns():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4, 5, 6))
    for op in ops.OPS.values():
        if not op.statistics:
            continue
        args = (2,) if op.name == "group_norm" else ()
        results = op.reference(x, *args, return_stats=True)
        assert len(results) == 1 + len(op.statistics), op.name


def _torch_ops():
    torch = pytest.importorskip("torch")
    import cunorm.torch  # noqa: F401  (registers the operators)

    return torch


def test_the_torch_schemas_are_built_from_the_table():
    torch = _torch_ops()
    from cunorm.torch import _operators

    for name, expected in SCHEMAS.items():
        assert _operators.schema(ops.operators()[name]) == expected
        registered = str(getattr(torch.ops.cunorm, name).default._schema)
        assert registered == f"cunorm::{name}{expected}"


def test_each_operator_is_defined_with_its_kernels():
    """Every operator of the table (and the quantized one) has a kernel for
    every device and a fake; the forward operators an autograd kernel (their
    formula), the backward and quantized ones none (their kernel refuses a
    recorded call: test_torch_gpu.py)."""
    torch = _torch_ops()
    forward = {pair[0].name for op in ops.OPS.values() for pair in op.pairs}
    names = set(ops.operators()) | {"row_norm_quantized"}
    assert forward < names
    for name in names:
        qualname = f"cunorm::{name}"
        has = lambda key: torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)  # noqa: E731
        assert has("CompositeExplicitAutograd") and has("Meta"), name
        assert has("Autograd") == (name in forward), name


def test_a_backward_that_records_runs_once_differentiable():
    """create_graph=True through a forward operator (meta tensors): the
    gradients' shapes as without it, and a second backward raises."""
    torch = _torch_ops()
    x = torch.empty(3, 40, device="meta", requires_grad=True)
    w = torch.empty(40, device="meta", requires_grad=True)
    dy = torch.empty(3, 40, device="meta", requires_grad=True)
    y = torch.ops.cunorm.rms_norm(x, w, None, [-1], 1e-6, True, 0)[0]
    dx, dw = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    assert (dx.shape, dw.shape) == (x.shape, w.shape)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


def _meta(torch, array):
    return torch.empty_strided(array.shape, [s // array.itemsize for s in array.strides], device="meta",
                               dtype=getattr(torch, str(array.dtype)))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
def test_the_fakes_shape_what_the_reference_returns(channels_last, stats):
    """Every forward operator's fake on meta tensors: the outputs the
    reference returns for the same call, in shape and (statistics) dtype,
    y in x's memory layout for the channel norms and C order for the rows."""
    torch = _torch_ops()
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 6, 3, 5)).astype(np.float32)
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    c = np.ones(6, np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    t = torch.ops.cunorm
    calls = {
        "rms_norm": (lambda: t.rms_norm(_meta(torch, x), None, _meta(torch, r), [2, 3], 1e-5, stats, 0),
                     lambda: cunorm.reference.rms_norm(x, residual=r, axis=(2, 3), return_stats=stats)),
        "layer_norm": (lambda: t.layer_norm(_meta(torch, x), None, None, None, [1, 2, 3], 1e-5, stats, 0),
                       lambda: cunorm.reference.layer_norm(x, axis=(1, 2, 3), return_stats=stats)),
        "group_norm": (lambda: t.group_norm(_meta(torch, x), 3, _meta(torch, c), None, 1e-5, 1, stats, 0),
                       lambda: cunorm.reference.group_norm(x, 3, c, return_stats=stats)),
        "instance_norm": (lambda: t.instance_norm(_meta(torch, x), None, None, 1e-5, 1, stats, 0),
                          lambda: cunorm.reference.instance_norm(x, return_stats=stats)),
        "batch_norm": (lambda: t.batch_norm(_meta(torch, x), None, None, _meta(torch, c), _meta(torch, c), True, 0.1,
                                            1e-5, 1, stats, 0),
                       lambda: cunorm.reference.batch_norm(x, running_mean=c.copy(), running_var=c.copy(),
                                                           return_stats=stats)),
    }
    for name, (fake, want) in calls.items():
        got = fake()
        expected = want()
        expected = list(expected) if isinstance(expected, tuple) else [expected]
        if name == "batch_norm":  # (the functional operator returns the updated buffers too)
            assert [tuple(b.shape) for b in got[len(expected):]] == [(6,), (6,)]
            got = got[:len(expected)]
        assert [tuple(g.shape) for g in got] == [e.shape for e in expected], name
        assert [str(g.dtype) for g in got[1 + ops.OPS[name].residual:]] == ["torch.float32"] * (len(got) - 1 -
                                                                                                ops.OPS[name].residual)
        y = got[0]
        if ops.OPS[name].family == "channels" and channels_last:
            assert y.is_contiguous(memory_format=torch.channels_last), name
        else:
            assert y.is_contiguous(), name


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_conditioned_operators_autograd_formula_on_meta_tensors(kind):
    """The conditioned forward operator's fake and autograd formula, and the
    modulated backward operator's fake, on meta tensors: the outputs and
    every gradient in shape and dtype (adaLN-Zero: shift, scale and gate
    chunks of one modulation tensor, h = r + gate * x); the forms the fused
    backward does not take raise when differentiated."""
    torch = _torch_ops()
    t = torch.ops.cunorm
    batch, tokens, n = 2, 32, 256
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, device="meta", dtype=dtype,  # noqa: E731
                                                            requires_grad=True)
    x, r, w, b, mod = meta(batch, tokens, n), meta(batch, tokens, n), meta(n), meta(n), meta(batch, 6 * n)
    shift, scale, gate = (m.unsqueeze(1) for m in mod.chunk(6, -1)[:3])
    if kind == "rms":
        out = t.rms_norm_conditioned(x, w, r, shift, scale, gate, None, [-1], 1e-6, True, 0)
        leaves = [x, r, w, mod]
    else:
        out = t.layer_norm_conditioned(x, w, b, r, shift, scale, gate, [-1], 1e-6, True, 0)
        leaves = [x, r, w, b, mod]
    assert [(tuple(o.shape), o.dtype) for o in out[:2]] == [((batch, tokens, n), torch.bfloat16)] * 2
    assert [(tuple(o.shape), o.dtype) for o in out[2:]] == [((batch, tokens), torch.float32)] * (
        1 if kind == "rms" else 2)
    grads = torch.autograd.grad(out[0].sum() + out[1].sum(), leaves)
    assert [(g.shape, g.dtype) for g in grads] == [(a.shape, a.dtype) for a in leaves]
    z = meta(batch, tokens, n)  # (the gated form: its own backward operator, test_gated.py)
    y = t.rms_norm_conditioned(x, w, None, None, None, None, z, [-1], 1e-6, True, 0)[0]
    assert [g.shape for g in torch.autograd.grad(y.sum(), [x, z])] == [x.shape, z.shape]
    with pytest.raises(RuntimeError, match="per-head weights"):
        heads = meta(tokens, n)
        y = t.rms_norm_conditioned(x, heads, None, shift, None, None, None, [-1], 1e-6, True, 0)[0]
        torch.autograd.grad(y.sum(), [x])


def test_the_jax_functions_follow_the_table():
    pytest.importorskip("jax")
    import cunorm.jax as cj

    for op in ops.OPS.values():
        ours = inspect.signature(getattr(cj, op.name)).parameters
        public = inspect.signature(getattr(cunorm, op.name)).parameters
        assert [p for p in public if p != "out"] == [p for p in ours if p != "kwargs"], op.name
