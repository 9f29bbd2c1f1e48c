"""The launch cache: a call whose whole signature was seen before is a
dictionary lookup, the outputs' allocation and the launches.

The first call with a signature (every array's kind, dtype, shape, strides,
device and pointer alignment; the axes, eps and flags, each of its exact
Python type) is validated, planned and run by the general path
(row_norms.py, channel_norms.py, gradients.py). Where that path ran a
Program (launches.py) over the arrays as given, with nothing copied or cast
first, it stores an Entry here under the signature; a later call with the
same signature only checks that the arrays' GPU is the current one,
allocates its outputs with the caller's framework (torch's caching
allocator for torch tensors, CuPy's pool for CuPy arrays), writes the
pointers and launches on the caller's current stream. Checks that depend
on values beyond the signature do not arise on this path: it takes no
``out=`` (nothing to overlap) and the signature holds every array's device.

Only CuPy arrays and torch tensors are keyed (their adapters have the fast
half: cunorm/_interop/cupy.py, torch.py); a torch call that autograd or
dynamo must see is not keyed here (cunorm.torch has its own routes). The
caches are bounded (oldest out first) and safe under threads.
"""
from __future__ import annotations

from . import launches, quantize
from .caches import BoundedCache

MAX_ENTRIES = 2048


ROWS = BoundedCache(MAX_ENTRIES)
CHANNELS = BoundedCache(MAX_ENTRIES)
ROWS_GRAD = BoundedCache(MAX_ENTRIES)
CHANNELS_GRAD = BoundedCache(MAX_ENTRIES)
CACHES = (ROWS, CHANNELS, ROWS_GRAD, CHANNELS_GRAD)


def clear() -> None:
    for cache in CACHES:
        cache.clear()


_adapters: dict = {}


def adapter(x):
    """The fast half of x's adapter (cupy or torch), or None."""
    kind = type(x)
    ad = _adapters.get(kind)
    if ad is None and kind not in _adapters:
        from .. import _interop

        try:
            found = _interop.adapter_for(x)
        except TypeError:
            found = None
        ad = found if hasattr(found, "signatures") else None
        _adapters[kind] = ad
    return ad


def _int_axes(axis) -> bool:
    t = type(axis)
    return t is int or axis is None or (t is tuple and all(type(a) is int for a in axis))


def key(ad, x, *arrays, scalars=()):
    """The signature of a call: None when it cannot be keyed (an array of
    another kind than x's, a value of a type the signature does not
    hold exactly, autograd or dynamo watching a torch call)."""
    parts = ad.signatures(x, arrays)
    return None if parts is None else parts + scalars


def rows_key(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue=0, out_dtype=None,
             quantize=None, conditioned=None, group=None):
    """The signature of a row norm's call (None: not keyed); ``epilogue``:
    its FLAGS bits (validated); ``out_dtype``: y's dtype where it is not x's;
    ``quantize``: quantize='s (format, static scale, bound, group, scale
    layout, unquantized y asked), the one array given among the scale and the bound keyed with
    the others; ``conditioned``: the per-row operands (conditioning.py),
    keyed with the others; ``group``: rms_norm's group_size (an int), the
    arrays keyed as given (the entry's launcher runs over their memory,
    which the groups only view)."""
    ad = adapter(x)
    if ad is None or type(eps) is not float or type(return_stats) is not bool or not _int_axes(axis):
        return None
    if conditioned is not None:
        if not (group is None or type(group) is int):
            return None
        return key(ad, x, weight, bias, residual, *conditioned,
                   scalars=(norm, axis, eps, return_stats, epilogue, out_dtype, "conditioned", group))
    if quantize is None:
        return key(ad, x, weight, bias, residual, scalars=(norm, axis, eps, return_stats, epilogue, out_dtype))
    fmt, scale, bound, group, layout, plain = quantize
    if (type(fmt) is not str or not (group is None or type(group) is int)
            or not (layout is None or type(layout) is str) or type(plain) is not bool):
        return None
    return key(ad, x, weight, bias, residual, scale, bound,
               scalars=(norm, axis, eps, return_stats, epilogue, out_dtype, fmt, group, layout, plain))


def channel_key(norm, x, num_groups, weight, bias, running_mean, running_var, training, momentum, eps,
                channel_axis, return_stats, epilogue=0, out_dtype=None):
    """The signature of a channel norm's call (None: not keyed)."""
    ad = adapter(x)
    if (ad is None or type(eps) is not float or type(channel_axis) is not int or type(return_stats) is not bool
            or type(training) is not bool or type(momentum) is not float
            or not (num_groups is None or type(num_groups) is int)):
        return None
    return key(ad, x, weight, bias, running_mean, running_var,
               scalars=(norm, num_groups, training, momentum, eps, channel_axis, return_stats, epilogue, out_dtype))


def modulated_grad_key(norm, dy, h, x, dh, weight, bias, shift, scale, residual_gate, mean, rstd, axis):
    """The signature of a modulated row norm's backward (None: not keyed)."""
    ad = adapter(dy)
    if ad is None or not _int_axes(axis):
        return None
    return key(ad, dy, h, x, dh, weight, bias, shift, scale, residual_gate, mean, rstd,
               scalars=(norm, axis, "modulated"))


def grad_key(norm, dy, x, mean, rstd, weight, bias, dh, layout, eps):
    """The signature of a backward call (``layout``: a row norm's axes, or a
    channel norm's (num_groups, channel_axis, training); None: not keyed)."""
    ad = adapter(x)
    if ad is None or type(eps) is not float or not all(_int_axes(v) or type(v) is bool for v in layout):
        return None
    return key(ad, x, dy, mean, rstd, weight, bias, dh, scalars=(norm, layout, eps))


class Entry:
    """A prepared call: how to allocate each output (like an input of the
    same shape, dtype and C-contiguous layout, or from its physical shape,
    dtype and the permutation back to the logical axes), where each slot of
    the Program takes its pointer from (an input, an output, or null), and
    which outputs are returned. Calling it runs the call the general way;
    the caches hold the launcher generated from it (``launcher``)."""

    __slots__ = ("device", "program", "inputs", "specs", "makers", "sources", "returns", "single", "alloc",
                 "current_device", "pointer", "stream", "ad")

    def __init__(self, ad, device, program, inputs, outputs, sources, returns, likes=()):
        self.ad, self.device, self.program, self.inputs = ad, device, program, inputs
        likes = dict(likes) if getattr(ad, "empty_like", None) is not None else {}
        self.specs = tuple(_spec(ad, int(device), likes.get(i), shape, dtype, perm)
                           for i, (shape, dtype, perm) in enumerate(outputs))
        self.makers = tuple(_maker(ad, spec) for spec in self.specs)
        self.sources = tuple(sources)
        self.returns = tuple(returns)
        self.single = len(self.returns) == 1
        self.alloc = ad.workspace_allocator(device)
        self.current_device, self.pointer, self.stream = ad.current_device, ad.pointer, ad.stream

    def __call__(self, *inputs):
        """The results, or None where the call must take the general path
        (its arrays' GPU is not the current one)."""
        device = self.device
        if self.current_device() != device:
            return None
        arrays = list(inputs)
        for make in self.makers:
            arrays.append(make(inputs))
        pointer = self.pointer
        self.program.run([0 if k < 0 or arrays[k] is None else pointer(arrays[k]) for k in self.sources],
                         self.stream(device), self.alloc)
        if self.single:
            return arrays[self.returns[0]]
        return tuple(None if k < 0 else arrays[k] for k in self.returns)


def _spec(ad, device: int, like, shape, dtype, perm):
    """How an output is allocated: ("like", input index), ("template", a
    tensor empty_like copies the shape and dtype of: the adapter's
    ``template``), ("beside", shape, dtype, perm) or, where its layout is a
    quantize.Strided, ("strided", shape, dtype, strides, elements held)."""
    if like is not None:
        return ("like", like)
    shape, dtype = tuple(shape), ad.native_dtype(dtype)
    if isinstance(perm, quantize.Strided):
        return ("strided", shape, dtype, perm.strides, perm.held)
    make_template = getattr(ad, "template", None)
    found = make_template(device, shape, dtype) if make_template is not None and perm is None else None
    return ("beside", shape, dtype, perm) if found is None else ("template", found)


def _maker(ad, spec):
    """An output's allocation, called with the Entry's inputs: like an
    input (torch's empty_like parses no shape, dtype or device), else from
    the shape, beside the first input (torch's new_empty takes its device
    from the tensor)."""
    if spec[0] == "like":
        empty_like, k = ad.empty_like, spec[1]
        return lambda inputs: empty_like(inputs[k])
    if spec[0] == "template":
        empty_like, t = ad.empty_like, spec[1]
        return lambda inputs: empty_like(t)
    if spec[0] == "strided":
        empty_strided, (_, shape, dtype, strides, held) = ad.empty_strided, spec
        return lambda inputs: empty_strided(inputs[0], shape, dtype, strides, held)
    empty_beside, (_, shape, dtype, perm) = ad.empty_beside, spec
    return lambda inputs: empty_beside(inputs[0], shape, dtype, perm)


def launcher(e: Entry):
    """``e`` as one generated Python function: the same checks,
    allocations, pointer writes and launches as ``e(*inputs)`` with every
    index, offset, grid and argument slot written into the code, so a call
    runs no loop, helper frame or lookup of its own (Triton's launchers
    are built the same way). The source is made of identifiers and numbers
    cunorm formats itself; shapes, dtypes and the Program's buffers are
    bound by name. A launch hook (the tuning scripts) or a thread without a
    current context is handed to ``e`` itself."""
    program, device, n = e.program, int(e.device), len(e.inputs)
    args = ", ".join(f"a{i}" for i in range(n))
    scope = {"current_device": e.current_device, "generic": e, "launch_module": launches, "get_stream": e.stream,
             "p": e.pointer, "empty_like": getattr(e.ad, "empty_like", None), "empty_beside": e.ad.empty_beside,
             "empty_strided": getattr(e.ad, "empty_strided", None),
             "alloc": e.alloc, "lock": program.lock, "memset_async": launches.memset_async,
             "launch_kernel": launches.launch_kernel, "launch_cooperative_kernel": launches.launch_cooperative_kernel,
             "launch_dependent_kernel": launches.launch_dependent_kernel,
             "CUDADriverError": launches.CUDADriverError, "INVALID_CONTEXT": launches.INVALID_CONTEXT,
             "make_current": launches.make_current}
    code = [f"def launch({args}):",
            f"    if current_device() != {device}:",
            "        return None",
            "    if launch_module.step_hook is not None:",
            f"        return generic({args})"]
    for i, spec in enumerate(e.specs):
        if spec[0] == "like":
            code.append(f"    o{i} = empty_like(a{int(spec[1])})")
        elif spec[0] == "template":
            scope[f"template{i}"] = spec[1]
            code.append(f"    o{i} = empty_like(template{i})")
        elif spec[0] == "strided":
            scope[f"shape{i}"], scope[f"dtype{i}"], scope[f"strides{i}"], scope[f"held{i}"] = spec[1:]
            code.append(f"    o{i} = empty_strided(a0, shape{i}, dtype{i}, strides{i}, held{i})")
        else:
            scope[f"shape{i}"], scope[f"dtype{i}"], scope[f"perm{i}"] = spec[1:]
            code.append(f"    o{i} = empty_beside(a0, shape{i}, dtype{i}, perm{i})")

    def array(k: int) -> str:
        return "None" if k < 0 else f"a{k}" if k < n else f"o{k - n}"

    def pointer(slot: int, offset: int) -> str:
        if slot >= len(program.slots):  # a workspace
            offset += program.offsets[slot - len(program.slots)]
            value = "base"
        else:
            k = e.sources[slot]
            if k < 0:
                return "0"
            # x (the first input) is always there; another input may be None
            value = f"p(a{k})" if k == 0 else f"(0 if a{k} is None else p(a{k}))" if k < n else f"p(o{k - n})"
        return f"{value} + {int(offset)}" if offset else value

    code.append(f"    stream = get_stream({device})")
    if program.workspaces:
        code.append(f"    workspace, base = alloc({int(program.workspace_bytes)})")
        code += [f"    memset_async(base + {int(offset)}, 0, {int(nbytes)}, stream)" for offset, nbytes in program.zeroed]
    code += ["    try:", "        with lock:"]
    for j, step in enumerate(program.steps):
        scope[f"words{j}"] = step.words
        code += [f"            words{j}[{int(arg)}] = {pointer(slot, offset)}" for arg, slot, offset in step.fills]
        head = ", ".join(str(int(v)) for v in step.head)
        if step.cooperative:
            code.append(f"            launch_cooperative_kernel({head}, stream, {int(step.params_ptr)})")
        elif step.dependent is not None:
            scope[f"dependent{j}"] = step.dependent
            code.append(f"            launch_dependent_kernel(dependent{j}, stream, {int(step.params_ptr)})")
        else:
            code.append(f"            launch_kernel({head}, stream, {int(step.params_ptr)}, 0)")
    code += ["    except CUDADriverError as err:",
             "        if err.status != INVALID_CONTEXT:",
             "            raise",
             f"        make_current({device})",
             f"        return generic({args})"]
    if e.single:
        code.append(f"    return {array(e.returns[0])}")
    else:
        code.append(f"    return ({', '.join(array(k) for k in e.returns)},)")
    source = "\n".join(code) + "\n"
    exec(compile(source, "<cunorm launcher>", "exec"), scope)  # noqa: S102 - cunorm's own identifiers and numbers
    fn = scope["launch"]
    fn.entry, fn.source = e, source
    return fn


def replay(cache, key, *inputs):
    """The results of ``key``'s entry run over ``inputs``; None where there
    is no key or entry, or the entry declines (another GPU is current)."""
    if key is None:
        return None
    found = cache.get(key)
    if found is None:
        return None
    return found(*inputs)


def entry(ad, device, program, inputs, outputs, slots, returns, arrays=None):
    """The launcher of an Entry built from names: ``inputs`` names the call's
    arrays in the order the launcher is called with, ``outputs`` maps names
    to (shape, dtype, perm or a quantize.Strided layout), ``slots`` maps
    the Program's slot names to their source's name (a slot it does not
    name, or names None, is null),
    ``returns`` the outputs returned (None: a None in the results).
    ``arrays`` maps input names to the call's (CuPy) arrays: an output of
    an input's shape and dtype, unpermuted, is allocated like a
    C-contiguous one."""
    order = list(inputs) + list(outputs)
    where = {name: i for i, name in enumerate(order)}
    sources = [-1 if slots.get(slot) is None else where[slots[slot]] for slot in program.slots]
    rets = [-1 if name is None else where[name] for name in returns]
    likes = []
    for i, (shape, dtype, perm) in enumerate(outputs.values()):
        for name, a in (arrays or {}).items():
            if (perm is None and a is not None and tuple(a.shape) == tuple(shape) and a.dtype == dtype
                    and a.flags.c_contiguous):
                likes.append((i, where[name]))
                break
    return launcher(Entry(ad, device, program, tuple(inputs), outputs.values(), sources, rets, likes))
