"""The glue between the kernels on all cores: padding, reshapes and transposes into blocked layouts.

After FuseOps, the injective work around our kernels (the pad + reshape + transpose that blocks a
depthwise or VNNI kernel's input, a residual's reshape) is a function of its own that TVM's default
CPU lowering runs as written: one loop nest per op, each materialising its whole intermediate
tensor, on one core. MobileNetV2 FP32 spent 6 of 18 ms there, untuned; `fused_pad2_reshape4_transpose1`
(96 x 112 x 112 into [1, 6, 114, 114, 16]) took 0.89 ms. Inlining every op into the last and running
its outer loops in parallel took it to 0.41 ms (same bits, 2 cores, measured one function at a time).
MetaSchedule's random candidates for these functions were slower than the untuned ones, so tuning
never helped them; they are scheduled here and tuning leaves them alone.
"""

from __future__ import annotations

import math

PARALLEL_MIN = 1 << 14  # elements: below this a thread pool wake-up costs more than it saves


def run(mod, build):
    """The pass (after legalize and fuse, and epilogue fusion): (mod, {"scheduled"})."""
    mod, count = schedule_glue(mod)
    epilogues = build.results["epilogue_fusion"]
    build.log(f"compile: {epilogues['fused']} of {epilogues['kernels']} kernels compute the elementwise ops after "
              f"them in their write-back; {count} glue functions (padding, layout) run on all cores")
    return mod, {"scheduled": count}


def schedule_glue(mod):
    """mod (legalized and fused) with every unscheduled function made only of spatial blocks
    scheduled: intermediates inlined into the last block, its outer loops in parallel.
    Returns (mod, how many functions)."""
    from tvm import tirx

    count = 0
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or (func.attrs is not None
                                                   and bool(func.attrs.get("tirx.is_scheduled", False))):
            continue
        scheduled = _schedule(func)
        if scheduled is not None:
            mod[gvar] = scheduled.with_attr("tirx.is_scheduled", True)
            count += 1
    return mod, count


def _schedule(func):
    """The scheduled func, or None where it has a reduction, a dynamic shape or too little work."""
    import tvm
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except (s_tir.schedule.ScheduleError, tvm.error.TVMError):  # no root block: not LegalizeOps' making
        return None
    if not blocks or any(iv.iter_type != tirx.IterVar.DataPar for b in blocks for iv in sch.get(b).iter_vars):
        return None
    for block in blocks[:-1]:
        try:
            sch.compute_inline(block)
        except s_tir.schedule.ScheduleError:  # e.g. read by two blocks: it stays a loop nest of its own
            pass
    last = sch.get_child_blocks(sch.get_sblock("root"))[-1]
    loops = sch.get_loops(last)
    try:
        extents = [int(sch.get(loop).extent) for loop in loops]
    except TypeError:  # a symbolic extent
        return None
    total = math.prod(extents)
    if len(loops) < 2 or total < PARALLEL_MIN:
        return None
    # the two innermost loops stay a row for each thread, unless that leaves too few rows to share
    outer = loops[:-2] if len(loops) > 2 and total // (extents[-1] * extents[-2]) >= 8 else loops[:-1]
    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    return sch.mod["main"]
