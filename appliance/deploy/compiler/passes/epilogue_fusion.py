"""Epilogue fusion: the elementwise ops after a kernel of ours computed in its write-back.

After legalize and fuse, FuseOps has put the elementwise ops after a kernel (bias, activation,
requantize, a residual add, the next layer's uint8 shift) into the kernel's function, as loop
nests of their own after it. Here they are inlined into the kernel's write-back (kernels/common.py:
WRITE_BACK), on the tile still in registers, a vector of 16 channels at a time. Each of them was a
pass of its own over the whole tensor, on one core (ResNet-18 int8: 9.6 of 20.3 ms). Every kernel
is then marked opaque, so a second FuseOps (the tuning pipeline's) joins nothing more to it.
"""

from __future__ import annotations

from appliance.deploy.compiler.kernels.common import KERNEL_BLOCK, OPAQUE, VECTORISED_BLOCKS, WRITE_BACK
from appliance.deploy.compiler.passes.rewrite import count_calls


def run(mod, build):
    """The pass: (mod, {"kernels", "fused"}) in layers (calls: layers of the same shapes and
    constants share one function); nothing to do where kernel dispatch used no kernel of ours."""
    names = {"kernels": set(), "fused": set()}
    mod, _, _ = fuse_epilogues(mod, names)
    return mod, {key: count_calls(mod, found.__contains__) for key, found in names.items()}


def fuse_epilogues(mod, names: dict | None = None):
    """mod (legalized and fused) with the epilogues computed in the kernels' write-backs (see the
    module docstring). Returns (mod, kernels, how many got their epilogue), in functions; `names`
    ({"kernels": set, "fused": set}) gets the functions' names."""
    from tvm import s_tir, tirx

    kernels = fused = 0
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        order = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
        if WRITE_BACK not in order:
            continue
        kernels += 1
        if names is not None:
            names["kernels"].add(gvar.name_hint)
        scheduled = func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
        if not scheduled:  # a kernel with the functions FuseOps joined to it
            inlined = _inline_epilogue(func, order)
            if inlined is not None:
                func, fused = inlined[0], fused + inlined[1]
                if inlined[1] and names is not None:
                    names["fused"].add(gvar.name_hint)
            func = func.with_attr("tirx.is_scheduled", True)  # else as FuseTIR made it: correct, slower
        # opaque from now on: a second FuseOps (the tuning pipeline's) joins nothing more to it
        mod[gvar] = func.with_attr("op_pattern", OPAQUE)
    return mod, kernels, fused


def _inline_epilogue(func, order: list):
    """func (a kernel and the elementwise functions FuseOps joined to it) with them computed in the
    kernel's write-back, vectorised over the tile's 16 channels where the channels need no bounds
    check: (func, all of them inlined?). Where TVM refuses a block, the ones before it are inlined
    and it and the rest stay loops of their own (correct, slower); None where none could be, or
    TVM failed (the function then stays as FuseTIR made it)."""
    import tvm
    from tvm import s_tir

    k = order.index(WRITE_BACK)
    before = [name for name in order[:k] if not name.startswith(KERNEL_BLOCK)]
    after = order[k + 1:]
    # a kernel with pixels as its vector lanes, or with a blocked output, has its write-back vectorised already
    count, vectorised = _chain(func, order[k:]), not any(name.startswith(VECTORISED_BLOCKS) for name in order[:k])
    while True:
        sch, done = s_tir.Schedule(func), 0
        try:
            for name in before:  # the other inputs' elementwise work (a residual's dequantize)
                sch.compute_inline(sch.get_sblock(name))
            for name in after[:count]:  # in order: each block into the write-back it now follows
                sch.reverse_compute_inline(sch.get_sblock(name))
                done += 1
            if vectorised:  # a pixel's 16 channels: one vector load of the tile, one vector epilogue
                *_, channels, rows = sch.get_loops(sch.get_sblock(WRITE_BACK))
                sch.reorder(rows, channels)
                sch.vectorize(channels)
                sch.unroll(rows)
            return (sch.mod["main"], count == len(after)) if count else None
        except tvm.error.InternalError:  # TVM 0.27's reverse_compute_inline fails inside on some
            return None  # MobileNetV3 and EfficientNet epilogues, and may leave the IR half-changed
        except s_tir.schedule.ScheduleError:  # refused, nothing changed: e.g. 24 channels of 32
            if done < count:
                count = done
            elif vectorised:
                vectorised = False
            else:
                return None


def _chain(func, blocks: list) -> int:
    """How many of blocks[1:] form a chain from the write-back blocks[0]: each the only reader of
    the one before's output. reverse_compute_inline of a block whose input has other readers
    (x * sigmoid(x), SiLU) drops that input's producer: TVM 0.27 does not refuse it."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    found = [sch.get(sch.get_sblock(name)) for name in blocks]
    reads = [{region.source.name for region in block.reads} for block in found]
    current = found[0].writes[0].source.name
    for j in range(1, len(found)):
        if [i for i in range(j, len(found)) if current in reads[i]] != [j]:
            return j - 1
        current = found[j].writes[0].source.name
    return len(found) - 1
