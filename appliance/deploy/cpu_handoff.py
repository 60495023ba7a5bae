"""An int8 1x1 convolution that feeds a depthwise one hands over its output in the depthwise layout.

MobileNet-style blocks expand with a 1x1 convolution, requantize, and run a depthwise one. The
depthwise kernel (cpu_conv.py) reads 16 channels of a pixel as one vector, [N, C/16, H, W, 16],
so between the two a pass of its own padded the NCHW output and transposed it into that layout:
MobileNetV2 int8's 17 such passes took about 0.4 of its 3.2 ms on 2 cores, a byte at a time. Here
the 1x1 convolution runs on the VNNI kernel that writes [N, O/16, H, W, 16] itself (a pixel's 16
sums one vector store: x86_int8.conv2d_kernel(blocked_out=True)), the requantize chain after it
is replayed on that layout (its per-channel constants blocked the same way), and only the
padding, 16 contiguous bytes per pixel, is left between the two kernels. The outputs are the
same bits: the same integer sums and the same elementwise ops on each value.

The chain must be elementwise ops each read once (the requantize `int8_rewrite` makes: subtract,
astype, multiply, add, quantize, clip, ...) whose other inputs are scalars or per-channel
[1, C, 1, 1] tensors, then the pad, reshape and transpose `_depthwise` emits. Anything else (a
residual add, a second reader) keeps the NCHW handover.
"""

from __future__ import annotations

import numpy as np

LANES = 16
ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
               "relax.astype", "relax.clip", "relax.quantize", "relax.dequantize", "relax.nn.relu"}
PIXEL_KERNEL, CHANNEL_KERNEL = "vnni_conv2d_pixels_", "vnni_conv2d_"
GEOMETRY = "appliance.stride_dilation"  # x86_int8.GEOMETRY


def blocked_handoff(mod):
    """mod (after x86_int8.use_vnni_kernels and cpu_conv.use_depthwise_int8_kernels) with each 1x1
    VNNI convolution whose requantized output only feeds a depthwise kernel writing that kernel's
    blocked layout; returns (mod, how many)."""
    from tvm import relax

    main = mod["main"]
    bindings = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    uses: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1

    for block in main.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, count)
    relax.analysis.post_order_visit(main.body.body, count)
    plans = {}
    for var, value in bindings.items():
        plan = _plan(mod, var, value, bindings, uses)
        if plan is not None:
            plans[var] = plan  # keyed by the blocked, padded input of a depthwise kernel
    if not plans:
        return mod, 0

    @relax.expr_functor.mutator
    class Handoff(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module = module

        def visit_var_binding_(self, binding):
            if binding.var in plans:
                new = _emit(self.builder_, self, plans[binding.var])
                self.set_var_remap(binding.var, new)
                return
            super().visit_var_binding_(binding)

    mutator = Handoff(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    out = relax.transform.DeadCodeElimination()(mutator.builder_.get())
    return out, len(plans)


def _op(value) -> str | None:
    import tvm
    from tvm import relax

    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _plan(mod, var, value, bindings, uses):
    """For `var` = permute_dims(reshape(pad(chain(call_tir(pixel 1x1 kernel))))) read by a depthwise
    kernel: what to emit instead; None for anything else."""
    from tvm import relax

    if _op(value) != "relax.permute_dims" or [int(a) for a in value.attrs.axes] != [0, 1, 3, 4, 2]:
        return None
    reshaped = value.args[0]
    if not isinstance(reshaped, relax.Var) or _op(bindings.get(reshaped)) != "relax.reshape" or uses.get(reshaped) != 1:
        return None
    padded = bindings[reshaped].args[0]
    pad = bindings.get(padded)
    if not isinstance(padded, relax.Var) or _op(pad) != "relax.nn.pad" or uses.get(padded) != 1:
        return None
    chain, current = [], pad.args[0]
    while isinstance(current, relax.Var) and uses.get(current) == 1:
        step = bindings.get(current)
        if _op(step) == "relax.call_tir":
            break
        if _op(step) not in ELEMENTWISE or not isinstance(step.args[0], relax.Var):
            return None
        if any(not _side_input(arg) for arg in step.args[1:]):
            return None
        chain.append(step)
        current = step.args[0]
    else:
        return None
    call = bindings[current]
    kernel = call.args[0]
    if kernel.name_hint.startswith(PIXEL_KERNEL):
        geometry = (1, 1, 1, 1)
    elif kernel.name_hint.startswith(CHANNEL_KERNEL) and mod[kernel].attrs.get(GEOMETRY) is not None:
        geometry = tuple(int(v) for v in mod[kernel].attrs[GEOMETRY])
    else:
        return None
    n, o, h, w = [int(d) for d in current.ty.shape]
    if o % LANES or [int(p) for p in pad.attrs.pad_width[:4]] != [0, 0, 0, 0] or pad.attrs.pad_mode != "constant":
        return None
    data, weights = call.args[1]
    return {"data": data, "weights": weights.value.numpy(), "o": o, "out": (h, w), "n": n, "geometry": geometry,
            "pixels": kernel.name_hint.startswith(PIXEL_KERNEL), "chain": list(reversed(chain)), "pad": pad,
            "name": kernel.name_hint}


def _side_input(arg) -> bool:
    """A scalar, or a per-channel [1, C, 1, 1] tensor: what a requantize chain combines with."""
    shape = getattr(arg.ty, "shape", None)
    if shape is None:
        return False
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return False
    return len(dims) == 0 or dims == [1] or (len(dims) == 4 and dims[0] == dims[2] == dims[3] == 1)


def _emit(builder, mutator, plan):
    """Emit the blocked kernel, the chain on its layout and the padding; returns the padded var."""
    from tvm import relax

    from appliance.deploy import x86_int8

    n, o, (oh, ow) = plan["n"], plan["o"], plan["out"]
    sh, sw, dh, dw = plan["geometry"]
    packed = plan["weights"]
    if plan["pixels"]:  # cpu_pixels' [O/OT, C/4, OT, 4] -> x86_int8's [O/16, C/4, 1, 1, 16, 4]
        groups, c4, ot, _ = packed.shape
        packed = x86_int8.pack_weights(np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(o, c4 * 4, 1, 1))
    data = mutator.visit_expr(plan["data"])
    _, c4, h, w, _ = (int(d) for d in data.ty.shape)
    _, _, kh, kw, _, _ = packed.shape
    func, _ = x86_int8.conv2d_kernel(n, c4, h, w, o // LANES, kh, kw, (sh, sw), (dh, dw), blocked_out=True)
    kernel = builder.add_func(func.without_attr("global_symbol"), "vnni_conv2d_blocked_" + plan["name"].split("_")[-1])
    current = builder.emit(relax.call_tir(kernel, [data, relax.const(packed)],
                                          relax.TensorType((n, o // LANES, oh, ow, LANES), "int32")))
    for step in plan["chain"]:
        args = [current] + [_blocked(builder, mutator.visit_expr(arg), o) for arg in step.args[1:]]
        current = builder.emit(relax.Call(step.op, args, step.attrs, step.ty_args))
    pad = plan["pad"]
    top, bottom, left, right = (int(p) for p in pad.attrs.pad_width[4:])
    return builder.emit(relax.op.nn.pad(current, [0, 0, 0, 0, top, bottom, left, right, 0, 0],
                                        pad_value=float(pad.attrs.pad_value)))


def _blocked(builder, arg, o):
    """A side input on the blocked layout: per-channel [1, C, 1, 1] -> [1, C/16, 1, 1, 16]; scalars as they are."""
    from tvm import relax

    dims = [int(d) for d in arg.ty.shape]
    if len(dims) != 4:
        return arg
    return builder.emit(relax.op.permute_dims(relax.op.reshape(arg, (1, o // LANES, LANES, 1, 1)), [0, 1, 3, 4, 2]))
