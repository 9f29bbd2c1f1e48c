"""cunorm.jax's jit lowering built without a GPU: jax.export for the cuda
platform runs the abstract evaluation, the dispatch and the builders, and
emits the MLIR of every custom call (cunorm/jax/_jit.py) for a fake H100.
The proto each call carries needs jaxlib's GPU plugin and is stubbed here;
the PTX it names is compiled by NVRTC, as on the GPU."""
import dataclasses
import functools
import json
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
jax_export = pytest.importorskip("jax.export")

from cunorm._engine import dispatch_rows, declarations, launches, loader, plans  # noqa: E402
from cunorm.jax import _custom_call as cc  # noqa: E402
from helpers import clear_cunorm_caches  # noqa: E402

H100 = dispatch_rows.Device(sm_count=132, compute_capability=90, max_shared_per_block=227 * 1024,
                            l2_bytes=50 * 1024 * 1024)
BF16 = jnp.bfloat16


@pytest.fixture
def lowering(monkeypatch):
    """The jit module with the target GPU faked and the proto stubbed:
    (jit module, lower(f, *shape_dtypes) -> the custom calls' configs)."""
    from cunorm.jax import _jit as jj
    clear_cunorm_caches()
    monkeypatch.setattr(launches, "device_info", lambda device_id: H100)
    monkeypatch.setattr(launches, "_persistent_grid", lambda step, device: (2 * H100.sm_count,))
    monkeypatch.setattr(jj, "target", lambda: (0, H100, 90))

    def stub(call, arch):
        launch = call.launch
        return json.dumps({"kernel": launch.kernel.expression, "grid": list(launch.grid), "threads": launch.threads,
                           "shared": launch.shared, "params": [list(p) for p in call.params]}).encode()

    monkeypatch.setattr(cc, "backend_config", stub)
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # float64 x, as cunorm takes it

    def lower(f, *shape_dtypes):
        args = [jax.ShapeDtypeStruct(s, d) for s, d in shape_dtypes]
        exported = jax_export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax_export.DisabledSafetyCheck.custom_call("triton_kernel_call")])(*args)
        text = exported.mlir_module()
        configs = [json.loads(_mlir_string(s)) for s in re.findall(r'backend_config = "((?:[^"\\]|\\.)*)"', text)]
        assert text.count("triton_kernel_call") == len(configs) > 0
        return exported, configs

    yield jj, lower
    jax.config.update("jax_enable_x64", x64)
    clear_cunorm_caches()


def _mlir_string(s):
    """An MLIR string attribute's text: \\XX hex escapes."""
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), s)


def gradients(f, argnums):
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums)


ROW_CASES = {
    # name: (f(cj, x, w, b), x shape, dtype, parameter shape)
    "rms cached": (lambda cj, x, w, b: cj.rms_norm(x, w), (1024, 4096), BF16, (4096,)),
    "rms long rows": (lambda cj, x, w, b: cj.rms_norm(x, w), (4096, 32768), BF16, (32768,)),
    "rms streamed": (lambda cj, x, w, b: cj.rms_norm(x, w), (16, 40000), BF16, (40000,)),
    "rms streamed, one part": (lambda cj, x, w, b: cj.rms_norm(x, w), (2, 1 << 20), jnp.float32, (1 << 20,)),
    "layer_norm cached": (lambda cj, x, w, b: cj.layer_norm(x, w, b), (4096, 1024), jnp.float16, (1024,)),
    "layer_norm streamed": (lambda cj, x, w, b: cj.layer_norm(x, w, b), (4096, 32768), BF16, (32768,)),
    "layer_norm strided": (lambda cj, x, w, b: cj.layer_norm(x, w, b, axis=1), (8, 64, 33), jnp.float32, (64,)),
    "rms residual": (lambda cj, x, w, b: cj.rms_norm(x, w, residual=x * 2)[0], (300, 4097), jnp.float32, (4097,)),
    "normalize": (lambda cj, x, w, b: cj.normalize(x, 3.0), (300, 65535), jnp.float32, (1,)),
    "frobenius": (lambda cj, x, w, b: cj.frobenius_normalize(x, axis=None), (16, 64, 33), BF16, (1,)),
}

CHANNEL_CASES = {
    "group_norm NCHW": (lambda cj, x, w, b: cj.group_norm(x, 32, w, b), (8, 320, 16, 16), BF16, (320,)),
    "group_norm NHWC": (lambda cj, x, w, b: cj.group_norm(x, 32, w, b, channel_axis=-1), (8, 64, 64, 320), BF16,
                        (320,)),
    "instance_norm": (lambda cj, x, w, b: cj.instance_norm(x, w, b), (4, 24, 9, 11), jnp.float32, (24,)),
    # without parameters, channels-first: a row norm in disguise (the rows' results reshaped back)
    "group_norm rows": (lambda cj, x, w, b: cj.group_norm(x, 4, return_stats=True)[0], (2, 8, 5, 7), jnp.float32,
                        (8,)),
    "instance_norm rows": (lambda cj, x, w, b: cj.instance_norm(x), (3, 16, 33), BF16, (16,)),
    "batch_norm": (lambda cj, x, w, b: cj.batch_norm(x, w, b), (32, 256, 56, 56), BF16, (256,)),
    "batch_norm small": (lambda cj, x, w, b: cj.batch_norm(x, w, b), (3, 8, 5, 7), jnp.float64, (8,)),
}


def _cases():
    return [pytest.param(case, id=name) for name, case in {**ROW_CASES, **CHANNEL_CASES}.items()]


@pytest.mark.parametrize("case", _cases())
def test_forward_and_gradients_lower_to_custom_calls(lowering, case):
    jj, lower = lowering
    import cunorm.jax as cj

    f, shape, dtype, pshape = case
    f = functools.partial(f, cj)
    specs = ((shape, dtype), (pshape, jnp.float32), (pshape, jnp.float32))
    exported, forward = lower(f, *specs)
    assert exported.out_avals[0].shape == shape and exported.out_avals[0].dtype == dtype
    _, backward = lower(gradients(f, (0, 1, 2)), *specs)
    assert len(backward) > len(forward)
    for config in forward + backward:
        name = re.match(r"cunorm::(\w+)<", config["kernel"]).group(1)
        decl = next(d for d in declarations.DECLARATIONS if d.name == name)
        assert len(config["params"]) == len(decl.args), config["kernel"]
        assert 0 < config["threads"] <= 1024 and config["threads"] % 32 == 0
        assert all(0 < g < 2 ** 31 for g in config["grid"])
    # (no launch is cooperative: the recorder refuses those, so lowering would have raised)


def test_batch_norm_running_buffers_and_vmap_lower(lowering):
    jj, lower = lowering
    import cunorm.jax as cj

    def train(x, w, b, rm, rv):
        y, rm, rv = cj.batch_norm(x, w, b, running_mean=rm, running_var=rv, momentum=0.2)
        return y, rm, rv

    c = (16,)
    exported, _ = lower(train, ((4, 16, 7, 9), jnp.float32), (c, jnp.float32), (c, jnp.float32), (c, jnp.float32),
                        (c, jnp.float32))
    assert [a.shape for a in exported.out_avals] == [(4, 16, 7, 9), c, c]
    exported, _ = lower(jax.vmap(lambda x, w: cj.rms_norm(x, w), (0, None)), ((5, 33, 760), BF16), ((760,), BF16))
    assert exported.out_avals[0].shape == (5, 33, 760)


def test_plan_calls_binds_operands_results_and_aliases(lowering):
    """A recorded Program as custom calls: reads are operands, an absent
    pointer is a null scalar, a slot is written once, a read needs a writer."""
    jj, _ = lowering
    from cunorm._engine import gradients, dispatch_grad

    launch = dispatch_grad.choose_rows_grad("rms", np.dtype("float32"), np.dtype("float32"), 1, 4096, 1 << 20, 1, 4,
                                            H100, cooperative=False)
    recorder = launches.LaunchRecorder(gradients.ROW_GRAD_SLOTS, 0)
    gradients.build_rows_grad(recorder, launch, np.dtype("float32"), np.dtype("float32"), 4096, 1 << 20, 1, 1e-6,
                              (False, True, False, True, True, False))
    outputs = {"dx": ((4096, 1 << 20), np.float32), "dw": (((1 << 20),), np.float32)}
    calls = cc.plan_calls(recorder, {"dy": None, "x": None, "w": None, "scale": None}, outputs)
    assert [c.launch.kernel.name for c in calls] == [ln.kernel.name for ln in recorder.launches]
    written = [slot for c in calls for slot in c.results]
    assert len(written) == len(set(written)) and {"dx", "dw"} <= set(written)
    for c in calls:
        pointers = [(name, kind) for name, kind in c.launch.kernel.signature if kind in ("in", "out", "io")]
        assert len(c.operands) == sum(1 for name, kind in pointers if kind != "out"
                                      and c.launch.args[name] is not None)
        by_name = dict(zip((name for name, _ in c.launch.kernel.signature), c.params))
        for name, _ in pointers:
            if c.launch.args[name] is None:
                assert by_name[name] == ("scalar", 0, "i64"), (c.launch.kernel.name, name)
    with pytest.raises(RuntimeError, match="reads dy before anything wrote it"):
        cc.plan_calls(recorder, {"x": None, "w": None, "scale": None}, outputs)


def test_the_ptx_names_the_kernel_with_its_parameters(lowering):
    """NVRTC's PTX for compute_90 (what the proto carries): one entry, the
    lowered name, one .param for each declared argument."""
    jj, _ = lowering
    kernel = declarations.COLUMN_SUM("float", "float", 4)
    ptx, lowered = cc.kernel_ptx(kernel.family, kernel.expression, 90)
    entry = re.search(r"\.entry\s+(\S+)\s*\(([^)]*)\)", ptx)
    assert entry and entry.group(1) == lowered
    assert entry.group(2).count(".param") == len(kernel.signature)


def test_versions_outside_the_tested_range_are_refused(lowering):
    jj, _ = lowering
    low, high = cc.SUPPORTED_JAX
    cc.check_jax_version(f"{low[0]}.{low[1]}.0")
    with pytest.raises(RuntimeError, match="needs jax"):
        cc.check_jax_version(f"{high[0]}.{high[1]}.0")
    with pytest.raises(RuntimeError, match="needs jax"):
        cc.check_jax_version("0.4.30")


def _y_param(config):
    """rows_cached's y argument in a lowered call's params."""
    names = [n for n, _ in declarations.ROWS_CACHED.args]
    return config["params"][names.index("y")]


@pytest.mark.parametrize("shape,dtype,tier_skips_y", [((1024, 4096), jnp.float32, True), ((4096, 32768), BF16, True),
                                                      ((4, 1 << 20), jnp.float32, False),
                                                      ((64, 1 << 20), jnp.float32, "apply")],
                         ids=["cached", "long rows", "split", "split in tiles"])
def test_unread_y_is_not_written(lowering, shape, dtype, tier_skips_y):
    """jax.grad of a loss linear in y never reads y: jit's dead-code pass
    (_rows_dce) turns the forward into one that writes rstd alone, and
    rows_cached takes a null y; the split tier's apply in tiles, the one
    launch that writes y alone, is dropped as dead code; the other tiers
    write it anyway. A loss that reads y keeps it."""
    jj, lower = lowering
    import cunorm.jax as cj

    f = lambda x, w: cj.rms_norm(x, w)  # noqa: E731
    specs = ((shape, dtype), (shape[-1:], jnp.float32))
    dy = jnp.arange(shape[-1], dtype=jnp.float32)
    _, dead = lower(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * dy), (0, 1)), *specs)
    _, live = lower(jax.grad(lambda x, w: jnp.sum(jnp.square(f(x, w).astype(jnp.float32))), (0, 1)), *specs)
    forwards = [[c for c in calls if not re.match(r"cunorm::(rows_grad|column_sum)", c["kernel"])]
                for calls in (dead, live)]
    assert all(forwards)
    if tier_skips_y is True:
        (dead_forward,), (live_forward,) = forwards
        assert dead_forward["kernel"].startswith("cunorm::rows_cached<")
        assert _y_param(dead_forward) == ["scalar", 0, "i64"] and _y_param(live_forward) == ["array", 0]
    else:
        assert not any(c["kernel"].startswith("cunorm::rows_cached<") for c in forwards[0])
    if tier_skips_y == "apply":
        names = [[c["kernel"].split("<")[0] for c in calls] for calls in forwards]
        assert names == [["cunorm::rows_split_partial", "cunorm::rows_split_finalize"],
                         ["cunorm::rows_split_partial", "cunorm::rows_split_finalize", "cunorm::rows_split_apply_tiles"]]
        assert len(dead) == len(live) - 1
    else:
        assert len(dead) == len(live)


def _split_template(targs: str) -> list[str]:
    """Template arguments split at the top level (a stage's own stay whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(targs):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            parts.append(targs[start:i].strip())
            start = i + 1
    return parts + [targs[start:].strip()]


def _template_arg(config, param):
    """A template argument of a lowered call's kernel, by its parameter's
    name; P and FLAGS of a kernel with a store stage are the stage's
    (AffineStore<P, FLAGS, Y>). None where the kernel has neither."""
    name, targs = re.match(r"cunorm::(\w+)<(.*)>$", config["kernel"]).groups()
    decl = next(d for d in declarations.DECLARATIONS if d.name == name)
    args = _split_template(targs)
    if param in decl.template:
        return args[decl.template.index(param)]
    if param in ("P", "FLAGS") and "STORE" in decl.template:
        store = re.match(r"cunorm::AffineStore<(.*)>$", args[decl.template.index("STORE")])
        return _split_template(store.group(1))[("P", "FLAGS").index(param)] if store else None
    return None


def _template_flags(config):
    flags = _template_arg(config, "FLAGS")
    return None if flags is None else int(flags)


SILU, GELU = 2 << 4, 3 << 4  # plans.ACTIVATIONS << ACTIVATION_SHIFT


@pytest.mark.parametrize("shape", [(1024, 4096), (16, 40000)], ids=["cached", "streamed"])
def test_epilogue_options_fuse_in_the_forward_and_unfuse_under_grad(lowering, shape):
    """Inside jit, rms_norm's weight offset, rounding and activation are the
    forward kernel's FLAGS (1 weight | 4 offset | 8 rounding | silu); under
    jax.grad the forward keeps the rounding alone (the offset and the
    activation are jax ops there) and the backward kernels take no epilogue."""
    jj, lower = lowering
    import cunorm.jax as cj

    f = lambda x, w: cj.rms_norm(x, w, weight_offset=1, rounding="normalized", activation="silu")  # noqa: E731
    specs = ((shape, BF16), (shape[-1:], BF16))
    _, forward = lower(f, *specs)
    assert {_template_flags(c) for c in forward} - {None} == {1 | 4 | 8 | SILU}
    _, both = lower(gradients(f, (0, 1)), *specs)
    flags = [_template_flags(c) for c in both if _template_flags(c) is not None]
    assert 1 | 8 in flags and all(fl & ~(1 | 2 | 8) == 0 for fl in flags), flags
    # (the offset weight, 1 + w, goes in as float32)
    assert {_template_arg(c, "P") for c in both} - {None} == {"float"}


@pytest.mark.parametrize("name,f,shape,pshape,flags", [
    ("layer_norm", lambda cj, x, w, b: cj.layer_norm(x, w, b, activation="gelu"), (64, 1000), (1000,), 3 | GELU),
    ("group_norm NHWC", lambda cj, x, w, b: cj.group_norm(x, 32, w, b, channel_axis=-1, activation="silu"),
     (8, 16, 16, 320), (320,), 3 | SILU),
    ("group_norm rows", lambda cj, x, w, b: cj.group_norm(x, 4, activation="silu"), (2, 8, 5, 7), (8,), SILU),
    ("batch_norm", lambda cj, x, w, b: cj.batch_norm(x, w, b, activation="relu"), (4, 16, 9, 9), (16,), 3 | 1 << 4),
], ids=lambda v: v if isinstance(v, str) else "")
def test_activation_fuses_in_every_family(lowering, name, f, shape, pshape, flags):
    jj, lower = lowering
    import cunorm.jax as cj

    f = functools.partial(f, cj)
    specs = ((shape, jnp.float32), (pshape, jnp.float32), (pshape, jnp.float32))
    _, forward = lower(f, *specs)
    assert flags in {_template_flags(c) for c in forward}, forward
    _, both = lower(gradients(f, (0, 1, 2)), *specs)
    assert all(_template_flags(c) is None or _template_flags(c) & ~3 == 0 for c in both)


def test_traced_calls_check_the_epilogue_as_eager_calls_do():
    """The epilogue's arguments are checked at trace time with the eager
    op's errors (no GPU needed: make_jaxpr stops before lowering)."""
    import cunorm.jax as cj

    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    trace = lambda f: jax.make_jaxpr(f)(x, w)  # noqa: E731
    with pytest.raises(ValueError, match="weight_offset must be 0 or 1"):
        trace(lambda x, w: cj.rms_norm(x, w, weight_offset=2))
    with pytest.raises(ValueError, match="weight_offset=1 needs a weight"):
        trace(lambda x, w: cj.rms_norm(x, weight_offset=1))
    with pytest.raises(ValueError, match="rounding must be one of"):
        trace(lambda x, w: cj.rms_norm(x, w, rounding="input"))
    with pytest.raises(ValueError, match="activation must be None or one of"):
        trace(lambda x, w: cj.layer_norm(x, w, activation="tanh"))
    with pytest.raises(TypeError, match="activation must be None or one of"):
        trace(lambda x, w: cj.group_norm(x.reshape(2, 4, 4), 2, activation=len))
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_ofset'"):
        trace(lambda x, w: cj.rms_norm(x, w, weight_ofset=1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'rounding'"):
        trace(lambda x, w: cj.layer_norm(x, w, rounding="normalized"))


# -- lowering for a named architecture, no GPU needed -------------------------------------------------------------


@pytest.fixture
def named_target(monkeypatch):
    """The jit module with only the proto stubbed: the target comes from
    set_lowering_target, and nothing may ask the driver (gpu_name raises)."""
    import cunorm.jax as cj

    clear_cunorm_caches()

    def no_driver():
        raise AssertionError("asked the CUDA driver while lowering for a named target")

    monkeypatch.setattr(loader, "gpu_name", no_driver)
    monkeypatch.setattr(cc, "backend_config", lambda call, arch: json.dumps(
        {"kernel": call.launch.kernel.expression, "grid": list(call.launch.grid), "threads": call.launch.threads,
         "shared": call.launch.shared, "arch": arch}).encode())
    yield cj
    cj.set_lowering_target(None)
    clear_cunorm_caches()


def _lowered_configs(f, *shape_dtypes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shape_dtypes]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [json.loads(_mlir_string(s)) for s in re.findall(r'backend_config = "((?:[^"\\]|\\.)*)"', text)]


def test_lowering_without_a_gpu_or_a_target_names_the_setting(monkeypatch):
    import cunorm.jax as cj

    monkeypatch.setattr(loader, "gpu_name", lambda: None)
    cc._gpu_target.cache_clear()
    cj.set_lowering_target(None)
    try:
        with pytest.raises(RuntimeError, match=r"sees none\. Name it first: cunorm\.jax\.set_lowering_target"):
            _lowered_configs(lambda a, b: cj.rms_norm(a, b), ((8, 4096), BF16), ((4096,), jnp.float32))
    finally:
        cc._gpu_target.cache_clear()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", 89, "sm_86"])
def test_a_named_target_lowers_with_its_own_occupancy(named_target, arch):
    """Long rows (rows_uncached's persistent grid) and the backward's cached
    rows (rows_grad_cached, persistent) planned for the named part: grids
    capped at the blocks its occupancy rules let be resident, from NVRTC's
    resource report for that architecture; the PTX for its compute
    capability."""
    from cunorm._engine import targets

    cj = named_target
    target = cj.set_lowering_target(arch)
    assert target == targets.named(arch)
    forward = _lowered_configs(lambda a, b: cj.rms_norm(a, b), ((4096, 65536), BF16), ((65536,), jnp.float32))
    grads = _lowered_configs(jax.grad(lambda a, b: jnp.sum(cj.rms_norm(a, b).astype(jnp.float32)), (0, 1)),
                             ((8192, 4096), BF16), ((4096,), jnp.float32))
    assert {c["arch"] for c in forward + grads} == {target.arch}
    checked = 0
    for config in forward + grads:
        name = re.match(r"cunorm::(\w+)<", config["kernel"]).group(1)
        if name not in ("rows_uncached", "rows_grad_cached"):
            continue
        family = next(d for d in declarations.DECLARATIONS if d.name == name).family
        registers, shared = loader.kernel_resources(family, config["kernel"], target.arch)
        per_sm = target.resident_per_sm(registers, shared, config["threads"], config["shared"])
        assert per_sm >= 1
        rows = 4096 if name == "rows_uncached" else 8192
        assert config["grid"][0] == min(rows, per_sm * target.device.sm_count), config
        checked += 1
    assert checked == 2


def test_named_targets_and_their_errors():
    from cunorm._engine import targets

    h100 = targets.named("sm_90")
    assert h100.device.sm_count == 132 and h100.arch == 90
    pcie = targets.named(90, sm_count=114)
    assert pcie.device.sm_count == 114 and pcie.device.max_shared_per_block == h100.device.max_shared_per_block
    assert targets.device_id(pcie) != targets.device_id(h100) < 0
    assert targets.device_id(targets.named(90, sm_count=114)) == targets.device_id(pcie)
    for bad in ("sm_70", 75, "h100", None, 9.0):
        with pytest.raises(ValueError, match="unknown target"):
            targets.named(bad)
    with pytest.raises(ValueError, match="sm_count must be a positive int"):
        targets.named("sm_90", sm_count=0)


@pytest.mark.parametrize("arch,registers,shared,threads,dynamic,expected", [
    # CUDA's occupancy rules, worked by hand: registers in 256-unit warps over four sub-partitions,
    # shared memory plus the 1 KB reserve in 128-byte units, warps and blocks an SM
    ("sm_90", 32, 0, 256, 0, 8),  # warps: 64 / 8
    ("sm_90", 128, 0, 512, 0, 1),  # registers: 4 warps a sub-partition, 16 of a block's 16
    ("sm_90", 64, 0, 1024, 0, 1),
    ("sm_90", 255, 0, 1024, 0, 0),  # over the register file: no block
    ("sm_90", 40, 404, 256, 102400, 2),  # shared: 233472 // 103936
    ("sm_90", 16, 0, 32, 0, 32),  # the block limit
    ("sm_86", 32, 0, 256, 0, 6),  # 48 warps / 8
    ("sm_86", 16, 0, 32, 0, 16),
    ("sm_89", 16, 0, 32, 0, 24),
    ("sm_80", 72, 0, 256, 0, 3),  # 72 -> 2304 a warp: 7 a sub-partition, 28 warps, 3 blocks of 8
    ("sm_80", 32, 0, 128, 165 * 1024, 0),  # (more than an SM's shared memory)
])
def test_occupancy_rules(arch, registers, shared, threads, dynamic, expected):
    from cunorm._engine import targets

    assert targets.named(arch).resident_per_sm(registers, shared, threads, dynamic) == expected


def test_changing_the_target_lowers_again(named_target):
    """jax caches lowerings: a change of target clears that cache, so the
    same jitted function lowers for the new target."""
    cj = named_target
    f = jax.jit(lambda a, b: cj.rms_norm(a, b))
    args = [jax.ShapeDtypeStruct((4096, 65536), BF16), jax.ShapeDtypeStruct((65536,), jnp.float32)]
    grids = []
    for arch in ("sm_90", "sm_80", "sm_90"):
        cj.set_lowering_target(arch)
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (config,) = [json.loads(_mlir_string(s)) for s in re.findall(r'backend_config = "((?:[^"\\]|\\.)*)"', text)]
        grids.append((config["arch"], config["grid"][0]))
    assert grids[0] == grids[2] and grids[0][0] == 90 and grids[1][0] == 80 and grids[1][1] != grids[0][1]


@pytest.mark.parametrize("scaling", ["row", "group", "static"])
def test_quantize_lowers_to_the_quantizing_store(lowering, scaling):
    """quantize= inside jit: one rows_cached call with the quantizing
    store; q in the format's dtype, then the scales (the static scale an
    operand instead), then h."""
    jj, lower = lowering
    import cunorm.jax as cj

    kwargs = {"row": {}, "group": {"quant_group": 128}, "static": {}}[scaling]

    def f(x, w, r, s):
        return cj.rms_norm(x, w, residual=r, quantize="float8_e4m3fn",
                           quant_scale=s if scaling == "static" else None, **kwargs)

    shape = (300, 4096)
    exported, (call,) = lower(f, (shape, BF16), (shape[-1:], BF16), (shape, BF16), ((1,), jnp.float32))
    group = 128 if scaling == "group" else 0
    mode = 0 if scaling == "static" else 1
    assert f"cunorm::QuantStore<cunorm::bf16_t, 1, cunorm::e4m3_t, {mode}, {group}>" in call["kernel"]
    want = [(shape, jnp.float8_e4m3fn)] + ([] if scaling == "static" else [
        ((300, 32) if group else (300, 1), jnp.float32)]) + [(shape, BF16)]
    assert [(tuple(a.shape), a.dtype) for a in exported.out_avals] == want
    with pytest.raises(ValueError, match="strided view"):
        lower(lambda x: cj.rms_norm(x, quantize="int8", quant_group=64, quant_scale_layout="column_major"),
              (shape, BF16))


def test_sharding_layouts_keep_the_normalized_axes_whole():
    """The primitives' arrays by their dimensions (cunorm/jax/_sharding.py):
    Shardy's rule, and the shardings and sums a partition takes from x's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cunorm.jax import _jit as jj, _sharding

    spec = jj.RowSpec("rms", (8, 6, 64), np.dtype(np.float32), 2, 2, 1e-5, residual=True, weight=True,
                      pdtype=np.dtype(np.float32), stats=True)
    text, factors = jj._rows_layout(spec).rule()
    assert text == "d0 d1 d2, d0 d1 d2, d2 -> d0 d1 d2, d0 d1 d2, d0 d1"  # x, r, w -> y, h, rstd
    assert factors == {"need_replication_factors": ("d2",)}
    grad = jj._rows_grad_layout(jj.RowGradSpec(spec, dh=True))
    assert grad.rule()[0] == "d0 d1 d2, d0 d1 d2, d0 d1 d2, d2, d0 d1 -> d0 d1 d2, d2"  # dy x dh w rstd -> dx dw
    assert grad.summed == {1}
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("a", "b", "c"))
    first, ins, outs, sums = _sharding._shardings(grad, mesh, NamedSharding(mesh, P("a", None, "b")))
    assert [tuple(s.spec) for s in outs] == [("a", None, None), (None,)]  # the normalized axis made whole
    assert tuple(ins[4].spec) == ("a", None) and sums == {1: ("a",)}
    strided = jj.RowSpec("ln", (4, 16, 5), np.dtype(np.float32), 1, 1, 1e-5, weight=True, bias=True,
                         pdtype=np.dtype(np.float32))
    grad = jj._rows_grad_layout(jj.RowGradSpec(dataclasses.replace(strided, stats=True)))
    _, _, outs, sums = _sharding._shardings(grad, mesh, NamedSharding(mesh, P("a", "b", ("c",))))
    assert sums == {1: ("a", "c"), 2: ("a", "c")}  # dweight and dbias over the axes before and after
    assert [tuple(s.spec) for s in outs] == [("a", None, "c"), (None,), (None,)]
    quant = jj.RowSpec("rms", (8, 6, 64), np.dtype(np.float32), 1, 2, 1e-5,
                       quant=("int8", 1, 32, "row_major", False))
    text, factors = jj._rows_layout(quant).rule()
    assert text == "d0 d1 d2 -> d0 d1 d2, d0 e1"  # (the scales: 12 groups of a row's 384)
    assert factors == {"need_replication_factors": ("d1", "d2", "e1")}


@pytest.mark.parametrize("norm, channels_last, whole, stats", [
    ("group", False, ("d1", "d2", "d3", "e0"), "d0 e0"),
    ("instance", True, ("d1", "d2", "d3"), "d0 d3"),
    ("batch", False, ("d0", "d1", "d2", "d3"), "d1"),
])
def test_channel_layouts_split_only_per_sample_statistics(norm, channels_last, whole, stats):
    from cunorm.jax import _jit as jj

    spec = jj.ChannelSpec(norm, (4, 8, 5, 8), np.dtype(np.float32), channels_last, 2 if norm == "group" else 8,
                          1e-5, weight=True, bias=True, pdtype=np.dtype(np.float32), stats=True)
    text, factors = jj._channels_layout(spec).rule()
    c = "d3" if channels_last else "d1"
    assert text == f"d0 d1 d2 d3, {c}, {c} -> d0 d1 d2 d3, {stats}, {stats}"
    assert factors["need_replication_factors"] == whole
    grad = jj._channels_grad_layout(jj.ChannelGradSpec(spec))
    assert grad.rule()[0] == f"d0 d1 d2 d3, d0 d1 d2 d3, {stats}, {stats}, {c} -> d0 d1 d2 d3, {c}, {c}"
    assert grad.summed == {1, 2}


CONDITIONED_CASES = {
    # name: (f(cj, x, r, w, m), x shape, dtype, weight shape, backward kernel the gradient runs)
    "adaLN-Zero": (lambda cj, x, r, w, m: cj.layer_norm(x, residual=r, shift=m[:, None, :64], scale=m[:, None, 64:128],
                                                        residual_gate=m[:, None, 128:192])[0],
                   (4, 64, 64), BF16, (64,), "rows_grad_modulated"),
    "modulated rms": (lambda cj, x, r, w, m: cj.rms_norm(x, w, shift=m[:, None, :64], scale=m[:, None, 64:128]),
                      (4, 64, 64), BF16, (64,), "rows_grad_modulated"),
    "per-token shift": (lambda cj, x, r, w, m: cj.rms_norm(x, w, shift=r), (4, 64, 64), jnp.float32, (64,),
                        "rows_grad_cached"),
    "per-head weights": (lambda cj, x, r, w, m: cj.rms_norm(x.reshape(4, 64, 4, 16), w.reshape(4, 16)),
                         (4, 64, 64), BF16, (64,), "rows_grad_cached"),
    "gated": (lambda cj, x, r, w, m: cj.rms_norm(x, w, gate=r, norm_before_gate=False), (4, 64, 64), BF16, (64,),
              "rows_grad_gated"),
    "gated, weight offset": (lambda cj, x, r, w, m: cj.rms_norm(x, w, gate=r, weight_offset=1), (4, 64, 64), BF16,
                             (64,), "rows_grad_gated"),
    "gated groups with a weight": (lambda cj, x, r, w, m: cj.rms_norm(x, w, gate=r, group_size=16), (4, 64, 64),
                                   BF16, (64,), "rows_grad_gated"),
    "float32 stream": (lambda cj, x, r, w, m: cj.rms_norm(x, w, residual=r.astype(jnp.float32))[0], (4, 64, 64),
                       BF16, (64,), "rows_grad_wide"),
    "float32 stream, LayerNorm": (lambda cj, x, r, w, m: cj.layer_norm(x, w, w, residual=r.astype(jnp.float32))[1],
                                  (4, 64, 64), BF16, (64,), "rows_grad_wide"),
    "float32 stream with a shift": (lambda cj, x, r, w, m: cj.rms_norm(x, w, residual=r.astype(jnp.float32),
                                                                       shift=m[:, None, :64])[0],
                                    (4, 64, 64), BF16, (64,), "rows_grad_cached"),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in CONDITIONED_CASES.items()])
def test_conditioned_forms_fuse_forward_and_backward(lowering, case):
    """Inside jit, a conditioned call is one rows_cached launch with its
    per-row operands' FLAGS; under jax.grad shift=, scale= and
    residual_gate= of one per-sample pattern run the fused modulated
    backward (rows_grad_modulated, its sums, column_sum), the gate and
    the float32 residual alone their own (rows_grad_gated, rows_grad_wide),
    the other forms the composed formula's (the plain backward kernels)."""
    jj, lower = lowering
    import cunorm.jax as cj

    f, shape, dtype, wshape, backward = case
    f = functools.partial(f, cj)
    specs = ((shape, dtype), (shape, dtype), (wshape, jnp.float32), ((shape[0], 192), dtype))
    exported, forward = lower(f, *specs)
    names = [re.match(r"cunorm::(\w+)<", c["kernel"]).group(1) for c in forward]
    assert names == ["rows_cached"], names
    # (the operands' bits in the store's FLAGS; the float32 stream is its load stage)
    assert _template_flags(forward[0]) & plans.CONDITIONED_FLAGS or "WideResidualLoad" in forward[0]["kernel"]
    _, both = lower(gradients(f, (0, 1, 2, 3)), *specs)
    names = [re.match(r"cunorm::(\w+)<", c["kernel"]).group(1) for c in both]
    assert backward in names and (backward == "rows_grad_modulated") == ("modulated_grad_sums" in names), names


def test_per_head_parameters_alone_take_the_plain_backward(lowering):
    """Under jax.grad, per-head parameters alone (QK-norm's layout) run
    the row primitive's own vjp: the plain backward over the heads
    (rows_grad_cached, its partials summed by column_sum into each head's
    row), no composed formula (no XLA reduction beside the loss's)."""
    jj, lower = lowering
    import cunorm.jax as cj

    f = lambda x, w, b: cj.layer_norm(x, w, b)  # noqa: E731
    specs = (((2, 5, 4, 16), BF16), ((4, 16), jnp.float32), ((4, 16), jnp.float32))
    grad = gradients(f, (0, 1, 2))
    jaxpr = jax.make_jaxpr(grad)(*[jnp.zeros(s, d) for s, d in specs])
    kinds = [e.primitive.name for e in jaxpr.eqns]
    assert kinds.count("cunorm_rows_grad") == 1 and kinds.count("reduce_sum") == 1, kinds
    assert [v.aval.shape for v in jaxpr.jaxpr.outvars] == [(2, 5, 4, 16), (4, 16), (4, 16)]
    _, configs = lower(grad, *specs)
    names = [re.match(r"cunorm::(\w+)<", c["kernel"]).group(1) for c in configs]
    assert names == ["rows_cached", "rows_grad_cached", "column_sum"], names
    assert configs[1]["params"][-1] == ["scalar", 4, "i32"]  # (heads)


def test_conditioned_layouts_shard_the_operands_with_their_rows():
    """A per-sample shift of (B, 1, H) against x of (B, T, H) shares x's
    batch label and keeps its own along T; a shard's spec reads its own
    rows (RowSpec.localized); the modulated backward sums dshift across
    the shards of T, dweight across those of B and T."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cunorm.jax import _jit as jj, _modulated, _sharding

    spec = jj.RowSpec("ln", (8, 6, 64), np.dtype(np.float32), 2, 2, 1e-5, residual=True, weight=True,
                      pdtype=np.dtype(np.float32), stats=True,
                      operands=(("shift", (8, 1, 64)), ("mod_scale", (8, 1, 64)), ("res_gate", (8, 1, 64))))
    assert spec.conditioning == (1, 6, 8)
    text, _ = jj._rows_layout(spec).rule()
    assert text == ("d0 d1 d2, d0 d1 d2, d2, d0 o1 d2, d0 o1 d2, d0 o1 d2 -> d0 d1 d2, d0 d1 d2, d0 d1, d0 d1")
    local = spec.localized((4, 3, 64))
    assert local.operands[0] == ("shift", (4, 1, 64)) and local.conditioning == (1, 3, 4)
    grad = _modulated._layout(_modulated.ModulatedGradSpec(spec, dh=True))
    assert list(_modulated.ModulatedGradSpec(spec, dh=True).outputs()) == ["dx", "dres", "dw", "dshift", "dscale",
                                                                           "dgate"]
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    _, _, outs, sums = _sharding._shardings(grad, mesh, NamedSharding(mesh, P("a", "b")))
    assert sums == {2: ("a", "b"), 3: ("b",), 4: ("b",), 5: ("b",)}
    assert [tuple(s.spec) for s in outs] == [("a", "b", None)] * 2 + [(None,)] + [("a", None, None)] * 3
    heads = jj.RowSpec("rms", (2, 5, 4, 16), np.dtype(np.float32), 3, 3, 1e-5, weight=True,
                       pdtype=np.dtype(np.float32), param_ndim=2)
    assert heads.param_rows == 4 and heads.conditioning == (4, 1, 1) and heads.param_shape == (4, 16)
    assert heads.localized((2, 5, 2, 16)).param_rows == 2


def test_the_gated_backward_layout_sums_dweight_over_the_rows():
    """rows_grad_gated's primitive: dy, x and z split with x, rstd with
    its rows, dweight summed across the shards of the rows (a weight a
    head split with the heads); the forms it takes (fusable_backward): the
    gate alone, whole rows or heads."""
    from cunorm.jax import _gated, _jit as jj

    spec = jj.RowSpec("rms", (8, 6, 64), np.dtype(BF16), 2, 2, 1e-5, weight=True, pdtype=np.dtype(np.float32),
                      stats=True, operands=(("gate", (8, 6, 64)),))
    grad = _gated.GatedGradSpec(spec, np.dtype(np.float32))
    assert list(grad.outputs()) == ["dx", "dz", "dw"] and grad.inputs() == ("dy", "x", "z", "w", "scale")
    layout = _gated._layout(grad)
    assert layout.rule()[0] == "d0 d1 d2, d0 d1 d2, d0 d1 d2, d2, d0 d1 -> d0 d1 d2, d0 d1 d2, d2"
    assert layout.summed == {2} and layout.whole == {"d2"}
    assert _gated.fusable_backward(spec)
    heads = dataclasses.replace(spec, shape=(8, 6, 4, 16), first=3, last=3, param_ndim=2,
                                operands=(("gate", (8, 6, 4, 16)),))
    assert _gated.fusable_backward(heads)  # (a weight a head: its dweight split with the heads)
    text, _ = _gated._layout(_gated.GatedGradSpec(heads, np.dtype(np.float32))).rule()
    assert text == "d0 d1 d2 d3, d0 d1 d2 d3, d0 d1 d2 d3, d2 d3, d0 d1 d2 -> d0 d1 d2 d3, d0 d1 d2 d3, d2 d3"
    shifted = dataclasses.replace(spec, operands=(("shift", (8, 1, 64)), ("gate", (8, 6, 64))))
    assert not _gated.fusable_backward(shifted)


def test_the_float32_residual_backward_layout_sums_the_parameters_over_the_rows():
    """rows_grad_wide's primitive: dy, h, dh, dx and dresidual split with
    x, the statistics with its rows, dweight and dbias summed across the
    shards of the rows; the forms it takes (fusable_backward): the float32
    residual alone, parameters over the normalized axes."""
    from cunorm.jax import _jit as jj, _wide

    spec = jj.RowSpec("ln", (8, 6, 64), np.dtype(BF16), 2, 2, 1e-5, residual=True, weight=True, bias=True,
                      pdtype=np.dtype(np.float32), stats=True, rdtype=np.dtype(np.float32))
    grad = _wide.WideGradSpec(spec)
    assert list(grad.outputs()) == ["dx", "dres", "dw", "db"]
    assert grad.inputs() == ("dy", "x", "dh", "w", "center", "scale")
    assert grad.outputs()["dres"] == ((8, 6, 64), np.dtype(np.float32)) and grad.outputs()["dx"][1] == BF16
    layout = _wide._layout(grad)
    assert layout.rule()[0] == ("d0 d1 d2, d0 d1 d2, d0 d1 d2, d2, d0 d1, d0 d1 -> d0 d1 d2, d0 d1 d2, d2, d2")
    assert layout.summed == {2, 3} and layout.whole == {"d2"}
    assert _wide.fusable_backward(spec)
    for other in (dataclasses.replace(spec, rdtype=None), dataclasses.replace(spec, operands=(("shift", (8, 1, 64)),)),
                  dataclasses.replace(spec, epilogue=plans.activation_flags("silu")),
                  dataclasses.replace(spec, shape=(8, 6, 16384))):
        assert not _wide.fusable_backward(other)
