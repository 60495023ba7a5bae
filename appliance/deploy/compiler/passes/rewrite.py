"""The generic Relax rewriter the passes share: replace calls one by one, count the replacements."""

from __future__ import annotations


def rewrite_calls(mod, replace):
    """mod with every call that `replace(builder, call, index)` returns an expression for replaced by
    it (None: kept); index counts the calls replaced so far. Returns (mod, how many were replaced)."""
    from tvm import relax

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module, self.count = module, 0

        def run(self):
            for gvar, func in self.module.functions_items():
                if isinstance(func, relax.Function):
                    self.builder_.update_func(gvar, self.visit_expr(func))
            return self.builder_.get()

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            replaced = replace(self.builder_, call, self.count)
            if replaced is None:
                return call
            self.count += 1
            return replaced

    rewriter = Rewriter(mod)
    out = rewriter.run()
    return out, rewriter.count


def count_calls(mod, name_matches) -> int:
    """How many call_tir of the Relax functions of mod call a PrimFunc whose name `name_matches`."""
    from tvm import relax

    calls = [0]

    def visit(expr):
        if (isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.call_tir"
                and name_matches(expr.args[0].name_hint)):
            calls[0] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return calls[0]
