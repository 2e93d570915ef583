"""A test-only pass that re-emits every jaxpr level through the interpreter, changing nothing."""

from hlopass.interpreter import rewrite
from hlopass.pass_base import Pass
from hlopass.registry import register_pass


@register_pass
class RetracePass(Pass):
    """Matches every equation, emits it unchanged: exercises the interpreter on any program."""

    name = "test_retrace"

    def run_level(self, closed, config, report):
        new = rewrite(closed)
        report.rewrite("retrace", "<test>", f"re-traced {len(closed.jaxpr.eqns)} equations")
        return new
