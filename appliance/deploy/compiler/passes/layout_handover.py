"""A convolution that feeds a depthwise one hands over its output in the depthwise layout.

MobileNet-style blocks expand with a 1x1 convolution (the first block: the stem's 3x3), apply
bias and ReLU6 (float32) or requantize (int8), and run a depthwise one. The depthwise kernel
(kernels/simd_depthwise.py) reads 16 channels of a pixel as one vector, [N, C/16, H, W, 16], so between the two
a pass of its own padded the NCHW output and transposed it into that layout, an element at a
time (MobileNetV2 int8: 17 such passes, about 0.4 of 3.2 ms on 2 cores). Here the convolution
runs on the channel-vector kernel that writes [N, O/16, H, W, 16] itself, a pixel's 16 channels
one vector store (x86_vnni / simd_conv.conv2d_kernel(blocked_out=True)), the elementwise chain
after it is replayed on that layout (per-channel constants blocked the same way), and only the
padding, 16 contiguous values per pixel, is left between the two kernels. The outputs are the
same: the same sums in the same order and the same elementwise ops on each value. Measured in
alternated A/B rounds: MobileNetV2 int8 x0.84 (3.21 -> 2.71 ms), float32 x0.93 (4.36 -> 4.06 ms).

The chain must be elementwise ops each read once (bias, ReLU6 as TVM's importer writes it, the
requantize passes/int8_arith.py makes) whose other inputs are scalars or per-channel [1, C, 1, 1]
tensors, then the pad, reshape and transpose simd_depthwise emits. A kernel a handover starts from names
its blocked twin in the registry (`Kernel.handover`). Anything else (a residual add,
a second reader, output channels not a multiple of 16) keeps the NCHW handover.

The other way round (`grouped_handoff`): an int8 depthwise layer whose output feeds an int8
dot-product kernel (the 1x1 projection after it) writes that kernel's input layout, [N, C/4, H, W, 4]
(4 channels a word: sdot, VNNI), from its own write-back, a pixel's 4-channel groups one store each.
Before, it wrote NCHW a byte at a time (the tile holds a pixel's 16 channels in one vector) and a
pass of its own transposed that into the words. Same sums, same elementwise ops: bit-identical
outputs. MobileNetV2 S8S8 at 224 px, `aarch64-dotprod`: 40.8 -> 36.8 M estimated Cortex-A76 cycles.
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels import simd_conv, x86_vnni
from appliance.deploy.compiler.kernels.simd_depthwise import depthwise_kernel
from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES
from appliance.deploy.compiler.kernels.registry import BY_NAME, blocked_kernel, kernel_named, kernels_for
from appliance.deploy.compiler.passes.rewrite import count_calls

ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
               "relax.astype", "relax.clip", "relax.quantize", "relax.dequantize", "relax.nn.relu"}


def run(mod, build):
    """The pass, after kernel dispatch: the int8 handovers where the int8 convolutions run on our
    kernels, then the float32 ones; adds "handoffs" and "pixels" (the kernels with 16 pixels a
    vector left after it) and "grouped" (int8 depthwise layers writing the next convolution's
    layout) to kernel dispatch's counts, and logs the kernels each layer got.
    Returns (mod, {"int8": handoffs, "float32": handoffs, "int8_grouped": grouped})."""
    dispatch = build.results["kernel_dispatch"]
    int8, fp32 = dispatch["int8"], dispatch["float32"]
    out = {"int8": 0, "float32": 0}
    layers = build.layers
    if int8["reason"] is None:
        mod, out["int8"] = blocked_handoff(mod)
        mod, out["int8_grouped"] = grouped_handoff(mod, build.cpu.tile)
        int8["grouped"] = out["int8_grouped"]
        int8.update(handoffs=out["int8"], pixels=_pixel_calls(mod, "int8"))
        build.log(f"compile: {int8['layers']} of {layers['int8']} int8 layers on {_label(build.cpu, 'int8')} kernels "
                  f"({int8['matmuls']} of them matmuls, as 1x1 convolutions; {int8['pixels']} with 16 pixels a vector; "
                  f"{int8['handoffs']} writing the depthwise layout after them), {int8['depthwise']} depthwise on "
                  f"vector kernels ({int8['grouped']} writing the next convolution's layout)")
    if fp32["reason"] is None:
        mod, out["float32"] = blocked_handoff(mod, build.cpu.tile)
        fp32.update(handoffs=out["float32"], pixels=_pixel_calls(mod, "float32"))
        build.log(f"compile: {fp32['layers']} of {layers['fp32']} float32 layers on {fp32['kind']} register-tiled "
                  f"kernels ({fp32['matmuls']} of them matmuls, as 1x1 convolutions; {fp32['pixels']} with 16 pixels "
                  f"a vector; {fp32['handoffs']} writing the depthwise layout after them; the rest: grouped)")
    return mod, out


def _label(cpu, group: str) -> str:
    return next((k.label for k in kernels_for(cpu, group) if k.label), group)


def _pixel_calls(mod, dtype: str) -> int:
    """How many layers of mod run on a kernel with 16 pixels a vector: its calls of the functions
    added under such a kernel's name (layers of the same shapes share one function)."""
    def pixels(name):
        kernel = kernel_named(name)
        return kernel is not None and kernel.pixels and kernel.dtype == dtype

    return count_calls(mod, pixels)


def _source(name: str):
    """The registry's kernel of a PrimFunc a handover may start from or stops at; None otherwise."""
    kernel = kernel_named(name)
    return kernel if kernel is not None and (kernel.handover or kernel.blocked) else None


def blocked_handoff(mod, tile: tuple | None = None):
    """mod (after kernel dispatch; with `tile`, the CPU's, for the float32 kernels too) with each
    convolution whose output only feeds a depthwise kernel, through elementwise ops, writing that
    kernel's blocked layout; returns (mod, how many)."""
    from tvm import relax

    main = mod["main"]
    bindings = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    uses = _uses(main)
    plans = {}
    for var, value in bindings.items():
        plan = _plan(mod, var, value, bindings, uses)
        if plan is not None and plan["dtype"] == "float32" and tile is None:
            plan = None
        if plan is not None:
            plans[var] = plan  # keyed by the blocked, padded input of a depthwise kernel
    return _apply(mod, plans, lambda builder, mutator, plan: _emit(builder, mutator, plan, tile))


def _apply(mod, plans: dict, emit):
    """mod with each binding of `plans` (var -> plan) replaced by what emit(builder, mutator, plan)
    returns, and the code left unused removed; (mod, how many)."""
    from tvm import relax

    if not plans:
        return mod, 0

    @relax.expr_functor.mutator
    class Handoff(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in plans:
                self.set_var_remap(binding.var, emit(self.builder_, self, plans[binding.var]))
                return
            super().visit_var_binding_(binding)

    mutator = Handoff(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(mutator.builder_.get()), len(plans)


def _uses(main) -> dict:
    """How many times each var of main is read."""
    from tvm import relax

    uses: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1

    for block in main.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, count)
    relax.analysis.post_order_visit(main.body.body, count)
    return uses


def grouped_handoff(mod, tile):
    """mod with each int8 depthwise layer whose output only feeds, through elementwise ops, a
    dot-product kernel's input layout ([N, C/g, H, W, g], g channels a word: the 1x1 projection of
    a MobileNet block) writing that layout itself (simd_depthwise's grouped kernel): the elementwise
    chain replayed on it, no transpose pass between, and no NCHW write-back storing a byte at a time.
    Returns (mod, how many)."""
    main = mod["main"]
    bindings = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    uses = _uses(main)
    plans = {}
    for var, value in bindings.items():
        plan = _grouped_plan(mod, value, bindings, uses)
        if plan is not None:
            plans[var] = plan
    return _apply(mod, plans, lambda builder, mutator, plan: _emit_grouped(builder, mutator, plan, tile))


def _grouped_plan(mod, value, bindings, uses):
    """For permute_dims(reshape(chain(call_tir(int8 depthwise kernel)), [n, C/g, g, h, w]), [0, 1, 3, 4, 2])
    (what an int8 dot-product kernel's lowering makes of its input): what to emit; None otherwise."""
    import tvm
    from tvm import relax

    if _op(value) != "relax.permute_dims" or [int(a) for a in value.attrs.axes] != [0, 1, 3, 4, 2]:
        return None
    reshaped = value.args[0]
    if not isinstance(reshaped, relax.Var) or _op(bindings.get(reshaped)) != "relax.reshape" or uses.get(reshaped) != 1:
        return None
    dims = [int(d) for d in reshaped.ty.shape]
    g = dims[2]
    if g not in (4, 8) or LANES % g:
        return None
    def depthwise(name):
        kernel = kernel_named(name)
        return kernel is not None and kernel.group == "int8-depthwise"

    found = _chain(mod, bindings[reshaped].args[0], bindings, uses, depthwise)
    if found is None:
        return None
    chain, current = found
    call = bindings[current]
    func = mod[call.args[0]]
    geometry = func.attrs.get(GEOMETRY) if func.attrs is not None else None
    data, weights = call.args[1]
    n, c, h, w = (int(d) for d in current.ty.shape)
    if geometry is None or c % LANES or not isinstance(weights, tvm.ir.GenericConst):
        return None
    return {"data": data, "weights": weights, "c": c, "g": g, "geometry": tuple(int(v) for v in geometry),
            "sums": str(current.ty.dtype), "chain": chain, "name": call.args[0].name_hint}


def _emit_grouped(builder, mutator, plan, tile):
    from tvm import relax

    data = mutator.visit_expr(plan["data"])
    n, c16, h, w, _ = (int(d) for d in data.ty.shape)
    _, kh, kw, _ = (int(d) for d in plan["weights"].ty.shape)
    sh, sw, dh, dw = plan["geometry"]
    dtype, sums, g, c = str(data.ty.dtype), plan["sums"], plan["g"], plan["c"]
    func, (oh, ow) = depthwise_kernel(n, c16, h, w, kh, kw, (sh, sw), (dh, dw), tile, dtype,
                                      sums if sums == "float32" else None, group=g)
    kernel = builder.add_func(func.without_attr("global_symbol"), "depthwise_grouped_" + plan["name"].split("_")[-1])
    current = builder.emit(relax.call_tir(kernel, [data, plan["weights"]],
                                          relax.TensorType((n, c // g, oh, ow, g), sums)))
    return _replay(builder, mutator, current, plan["chain"], c, g)


def _op(value) -> str | None:
    import tvm
    from tvm import relax

    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _plan(mod, var, value, bindings, uses):
    """For `var` = permute_dims(reshape(pad(chain(call_tir(conv kernel))), [n, C/16, 16, h, w])), the
    blocked input simd_depthwise makes: what to emit instead; None for anything else."""
    from tvm import relax

    if _op(value) != "relax.permute_dims" or [int(a) for a in value.attrs.axes] != [0, 1, 3, 4, 2]:
        return None
    reshaped = value.args[0]
    if not isinstance(reshaped, relax.Var) or _op(bindings.get(reshaped)) != "relax.reshape" or uses.get(reshaped) != 1:
        return None
    if [int(d) for d in reshaped.ty.shape][2] != LANES:  # 16 channels a vector (the VNNI input's blocks are 4)
        return None
    padded = bindings[reshaped].args[0]
    pad = bindings.get(padded)
    if not isinstance(padded, relax.Var) or _op(pad) != "relax.nn.pad" or uses.get(padded) != 1:
        return None
    found = _chain(mod, pad.args[0], bindings, uses, lambda name: _source(name) is not None)
    if found is None:
        return None
    chain, current = found
    call = bindings[current]
    kernel = call.args[0]
    kind = _source(kernel.name_hint)
    if kind is None or kind.handover is None:  # a blocked kernel already: no GEOMETRY, nothing to remake
        return None
    dtype, pixels = kind.dtype, kind.pixels
    if pixels:
        geometry = (1, 1, 1, 1)
    elif mod[kernel].attrs is not None and mod[kernel].attrs.get(GEOMETRY) is not None:
        geometry = tuple(int(v) for v in mod[kernel].attrs[GEOMETRY])
    else:
        return None
    n, o, h, w = [int(d) for d in current.ty.shape]
    if o % LANES or [int(p) for p in pad.attrs.pad_width[:4]] != [0, 0, 0, 0] or pad.attrs.pad_mode != "constant":
        return None
    data, weights = call.args[1]
    return {"data": data, "weights": weights.value.numpy(), "o": o, "out": (h, w), "n": n, "geometry": geometry,
            "dtype": dtype, "pixels": pixels, "chain": chain, "pad": pad, "name": kernel.name_hint,
            "blocked": blocked_kernel(kind).name}


def _elementwise(mod, step):
    """(op name, args) of a binding that is an elementwise op of the chain; (None, None) otherwise.
    A call_tir of a PrimFunc that is one max or min of its two inputs (how TVM's ONNX importer
    writes Clip: ReLU6's bounds) counts as relax.maximum / relax.minimum."""
    import tvm
    from tvm import relax, s_tir

    name = _op(step)
    if name in ELEMENTWISE:
        return name, list(step.args)
    if name != "relax.call_tir" or not isinstance(step.args[1], relax.Tuple) or len(step.args[1].fields) != 2:
        return None, None
    func = mod[step.args[0]]
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    body = sch.get(blocks[0]).body if len(blocks) == 1 else None
    if not isinstance(body, tvm.tirx.BufferStore):
        return None, None
    for kind, op in ((tvm.tirx.Max, "relax.maximum"), (tvm.tirx.Min, "relax.minimum")):
        loads = [getattr(getattr(v, "source", None), "name", None) for v in (body.value.a, body.value.b)
                 ] if isinstance(body.value, kind) else None
        if loads is not None and loads == [p.name for p in list(func.params)[:2]]:  # min/max(input 0, input 1)
            return op, list(step.args[1].fields)
    return None, None


def _side_input(arg) -> bool:
    """A scalar, or a per-channel [1, C, 1, 1] tensor: what a requantize chain combines with."""
    import tvm

    if isinstance(getattr(arg, "ty", None), tvm.ir.PrimType):  # a number: clip's bounds
        return True
    shape = getattr(arg.ty, "shape", None)
    if shape is None:
        return False
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return False
    return len(dims) == 0 or dims == [1] or (len(dims) == 4 and dims[0] == dims[2] == dims[3] == 1)


def _emit(builder, mutator, plan, tile):
    """Emit the blocked kernel, the chain on its layout and the padding; returns the padded var."""
    from tvm import relax

    n, o, (oh, ow) = plan["n"], plan["o"], plan["out"]
    sh, sw, dh, dw = plan["geometry"]
    packed = plan["weights"]
    data = mutator.visit_expr(plan["data"])
    if plan["dtype"] == "int8":  # data [N, C/4, H, W, 4], weights [O/16, C/4, KH, KW, ...] as the kernel packed them
        _, c4, h, w, _ = (int(d) for d in data.ty.shape)
        if plan["pixels"]:  # x86_vnni.pixels_kernel's [O/OT, C/4, OT, 4]
            packed = x86_vnni.pack_weights(np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(o, c4 * 4, 1, 1))
        kh, kw = packed.shape[2:4]
        make = BY_NAME[plan["blocked"]].make  # the dot-product kernel's own: x86_vnni, arm_dotprod
        func, _ = make(n, c4, h, w, o // LANES, kh, kw, (sh, sw), (dh, dw), blocked_out=True)
    else:  # data NCHW, weights simd_conv's [O/16, C, KH, KW, 16]
        _, c, h, w = (int(d) for d in data.ty.shape)
        if plan["pixels"]:  # x86_avx512's [O/OT, C, OT]
            packed = simd_conv.pack_weights(np.ascontiguousarray(packed.transpose(0, 2, 1)).reshape(o, c, 1, 1))
        _, _, kh, kw, _ = packed.shape
        func, _ = simd_conv.conv2d_kernel(n, c, h, w, o // LANES, kh, kw, (sh, sw), (dh, dw), tile, blocked_out=True)
    kernel = builder.add_func(func.without_attr("global_symbol"), plan["blocked"] + plan["name"].split("_")[-1])
    current = builder.emit(relax.call_tir(kernel, [data, relax.const(packed)],
                                          relax.TensorType((n, o // LANES, oh, ow, LANES),
                                                           "int32" if plan["dtype"] == "int8" else "float32")))
    current = _replay(builder, mutator, current, plan["chain"], o, LANES)
    pad = plan["pad"]
    top, bottom, left, right = (int(p) for p in pad.attrs.pad_width[4:])
    return builder.emit(relax.op.nn.pad(current, [0, 0, 0, 0, top, bottom, left, right, 0, 0],
                                        pad_value=float(pad.attrs.pad_value)))


def _chain(mod, start, bindings, uses, stop):
    """Walking up from `start` through elementwise ops each read once (side inputs scalars or
    per-channel tensors) to a call_tir of a PrimFunc whose name `stop` accepts: (the ops in the
    order they run, as (op, args, binding), the kernel call's var); None where anything else is met."""
    from tvm import relax

    chain, current = [], start
    while isinstance(current, relax.Var) and uses.get(current) == 1:
        step = bindings.get(current)
        if _op(step) == "relax.call_tir" and stop(step.args[0].name_hint):
            return list(reversed(chain)), current
        op, args = _elementwise(mod, step)
        if op is None or not isinstance(args[0], relax.Var) or any(not _side_input(arg) for arg in args[1:]):
            return None
        chain.append((op, args, step))
        current = args[0]
    return None


def _replay(builder, mutator, current, chain, channels: int, lanes: int):
    """The chain's ops emitted again on `current`, a blocked layout of `lanes` channels a block,
    their per-channel side inputs blocked the same way; the last one's var."""
    from tvm import relax

    for op, args, step in chain:
        args = [current] + [_blocked(builder, mutator.visit_expr(arg), channels, lanes) for arg in args[1:]]
        if _op(step) == "relax.call_tir":  # a max or min PrimFunc (_elementwise): the relax op on the new layout
            current = builder.emit(getattr(relax.op, op.split(".")[-1])(*args))
        else:
            current = builder.emit(relax.Call(step.op, args, step.attrs, step.ty_args))
    return current


def _blocked(builder, arg, o, lanes=LANES):
    """A side input on the blocked layout: per-channel [1, C, 1, 1] -> [1, C/lanes, 1, 1, lanes];
    scalars as they are."""
    import tvm
    from tvm import relax

    if isinstance(getattr(arg, "ty", None), tvm.ir.PrimType) or len(arg.ty.shape) != 4:
        return arg
    return builder.emit(relax.op.permute_dims(relax.op.reshape(arg, (1, o // lanes, lanes, 1, 1)), [0, 1, 3, 4, 2]))
