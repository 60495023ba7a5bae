"""Rewrites of an int8 graph after passes/int8_arith.py made its layers int8: fewer operations per
output, the same int8 values (or, for the folds, the same except next to a half; see each).

    fold_requantize  a layer's dequantize scale, bias and the next quantize in one multiply-add
    pool_int8        a QDQ model's max pooling on the int8 values
"""

from __future__ import annotations

import numpy as np

DEQUANTIZE = "relax.dequantize"
QUANT_DTYPES = ("int8", "uint8")


def _const(expr) -> np.ndarray:
    """The value of a constant the pattern matched (is_const)."""
    return expr.value.numpy()


def _dtype(expr) -> str:
    return expr.ty.dtype


def pool_int8(func):
    """func with max pooling on the int8 values where a QDQ model pools dequantized ones:

        max_pool2d(dequantize(q, s, z))  ->  dequantize(max_pool2d(q), s, z)         (s > 0)
        quantize(dequantize(x, s, z), s, z)  ->  x                                     (same dtype)

    Exact: dequantizing is non-decreasing, so it commutes with max (the int8 pool's padding, the
    dtype's minimum, is never above a real value, as float's -inf); and quantizing a dequantized
    int8 with its own scale and zero point gives it back (|x - z| <= 255: the float error is far
    below half a step). ResNet-18's stem otherwise writes its 64x112x112 output as float32 and pools
    and requantizes it in a function of its own."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, wildcard

    q, scale, zero = wildcard(), is_const(), is_const()
    pooled = is_op("relax.nn.max_pool2d")(is_op(DEQUANTIZE)(q, scale, zero))

    def pool(expr, matches):
        s, z = _const(matches[scale]), _const(matches[zero])
        if _dtype(matches[q]) not in QUANT_DTYPES or s.size != 1 or z.size != 1 or not float(s.reshape(())) > 0:
            return expr
        inner = relax.Call(expr.op, [matches[q]], expr.attrs)  # (a scalar scale: any axis)
        return relax.op.dequantize(inner, matches[scale], matches[zero], axis=1, out_dtype=str(_dtype(expr)))

    x, s1, z1, s2, z2 = wildcard(), is_const(), is_const(), is_const(), is_const()
    round_trip = is_op("relax.quantize")(is_op(DEQUANTIZE)(x, s1, z1), s2, z2)

    def identity(expr, matches):
        a, b = [_const(matches[v]) for v in (s1, z1)], [_const(matches[v]) for v in (s2, z2)]
        same = all(u.size == 1 and v.size == 1 and u.dtype == v.dtype and u.reshape(()) == v.reshape(())
                   for u, v in zip(a, b))
        if not same or _dtype(matches[x]) != str(expr.attrs.out_dtype) or _dtype(matches[x]) not in QUANT_DTYPES:
            return expr
        return matches[x]

    return relax.dpl.rewrite_call(round_trip, identity, relax.dpl.rewrite_call(pooled, pool, func))


MAX_FOLDED_CORRECTION = 256  # output steps: float32 rounds it by 256 * 2^-24 = 1.5e-5 of a step at most


def fold_requantize(func):
    """func with each requantize of an int8 layer's sums folded into one multiply-add:

        quantize(float(acc - c) * s + b, so, zo)  ->  quantize(float(acc - c) * (s/so) + (b/so + zo), 1, 0)

    (acc - c: the layer's int32 sums less their zero-point correction, s: its per-channel sx*sw, b: its
    bias, so/zo: the next quantize's scalar scale and zero point; "/so" is the multiply by 1/so that
    the quantize's legalization makes, passes/legalize_fuse.py). The write-back then does one
    multiply-add where it multiplied twice and added the zero point after rounding (onnxruntime's
    QLinearConv also requantizes with one combined multiplier). The int8 values are the same except
    where a float rounding puts a value on the other side of a half (the folded constants are
    rounded once to float32: about 1e-5 of an output step at |y| <= 256 steps). The zero-point
    correction c joins the constant too where c*s/so is at most MAX_FOLDED_CORRECTION output steps
    (the same error bound; no int32 subtraction left in the write-back); a larger one stays an int32
    subtraction (folded everywhere, MobileNetV2 S8S8 at 64 px: logits within 2 steps of
    onnxruntime's reference 97.6 -> 95.8 %; folded within the bound: 97.35 %)."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, wildcard

    correction, minuend = is_const(), wildcard()
    sums = is_op("relax.astype")(is_op("relax.subtract")(minuend, correction) | wildcard())
    scale = is_const()
    # the bias: a constant, or (a QDQ model's) int32 constant dequantized and reshaped to [1, C, 1, 1]
    dequantized, constant = is_op(DEQUANTIZE)(is_const(), is_const(), is_const()), is_const()
    bias = constant | dequantized | is_op("relax.reshape")(dequantized, wildcard())
    scaled = is_op("relax.multiply")(sums, scale)
    biased = is_op("relax.add")(scaled, bias) | is_op("relax.add")(bias, scaled)
    quantize = is_op("relax.quantize")(biased | scaled, is_const(), is_const())

    def rewriter(expr, matches):
        so, zo = expr.args[1].value.numpy(), expr.args[2].value.numpy()
        cast, s = matches[sums], _const(matches[scale])
        acc = cast.args[0]
        if (so.size != 1 or so.dtype != np.float32 or zo.size != 1 or _dtype(acc) != "int32"
                or _dtype(cast) != "float32" or s.dtype != np.float32):
            return expr
        with np.errstate(divide="ignore", over="ignore"):
            reciprocal = np.float32(1) / so.reshape(())
        if not np.isfinite(reciprocal) or reciprocal == 0:
            return expr
        folded = (s * reciprocal).astype(np.float32)
        offset = np.zeros((), np.float64)
        if bias in matches:  # (the match of an alternative is the var it is bound to: its parts' values)
            b = _value(matches[constant] if constant in matches else matches[dequantized])
            shape = [int(d) for d in matches[bias].ty.shape]
            if b is None or b.dtype != np.float32 or b.size != np.prod(shape, dtype=int):
                return expr
            offset = (b * reciprocal).astype(np.float64).reshape(shape)
        if correction in matches:  # float(acc - c) * s' = float(acc) * s' - c * s' where c * s' is small
            c = _const(matches[correction])
            shift = c.astype(np.float64) * folded.astype(np.float64)
            if c.dtype == np.int32 and np.abs(shift).max() <= MAX_FOLDED_CORRECTION:
                offset, acc = offset - shift, matches[minuend]
        offset = offset + float(zo.reshape(()))
        out = relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(folded))
        out = relax.op.add(out, relax.const(np.asarray(offset, np.float32)))
        return relax.op.quantize(out, relax.const(np.float32(1)), relax.const(np.zeros((), zo.dtype)),
                                 axis=int(expr.attrs.axis), out_dtype=str(expr.attrs.out_dtype))

    return relax.dpl.rewrite_call(quantize, rewriter, func)


def _value(expr) -> np.ndarray | None:
    """The value of a constant or of dequantize(constants) as TVM computes it ((q - zero) in float32,
    times the float32 scale); None for anything else."""
    import tvm
    from tvm import relax

    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    if expr.op.name == DEQUANTIZE and all(isinstance(a, tvm.ir.GenericConst) for a in expr.args):
        q, scale, zero = (a.value.numpy() for a in expr.args)
        if str(expr.attrs.out_dtype) != "float32" or q.dtype.kind not in "iu":
            return None
        axis, shape = int(expr.attrs.axis) % max(q.ndim, 1), [1] * q.ndim
        if q.ndim:
            shape[axis] = -1
        scale = scale.astype(np.float32).reshape(shape if scale.size > 1 else ())
        zero = zero.astype(np.int64).reshape(shape if zero.size > 1 else ())
        return (q.astype(np.int64) - zero).astype(np.float32) * scale
    return None
