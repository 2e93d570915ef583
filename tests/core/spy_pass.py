"""Test-only passes for the pipeline's gates, its progress lines and the persistent cache: each
counts its runs in :data:`RUNS` and changes nothing."""

import collections
import time

from hlopass import progress
from hlopass.pass_base import Pass
from hlopass.registry import register_pass
from hlopass.report import PassReport

#: pass name -> how many times the pipeline ran it (in this process)
RUNS: collections.Counter = collections.Counter()


@register_pass
class SpyPass(Pass):
    """Always applies (the default gate); changes nothing."""

    name = "test_spy"

    def run(self, closed, config):
        RUNS[self.name] += 1
        return closed, PassReport(self.name)


@register_pass
class SizeGatedSpyPass(SpyPass):
    """Applies only where a value is over the threshold."""

    name = "test_spy_gated"

    def applies(self, closed, config, facts):
        return facts.above(config.threshold)


@register_pass
class SlowPass(SpyPass):
    """Works for :attr:`seconds` on a named region."""

    name = "test_slow"
    seconds = 0.6

    def run(self, closed, config):
        RUNS[self.name] += 1
        with progress.at("the test's region"):
            time.sleep(self.seconds)
        return closed, PassReport(self.name)


#: ``gc.isenabled()`` as :class:`CollectorProbePass` found it, one entry per run
COLLECTOR: list = []


@register_pass
class CollectorProbePass(SpyPass):
    """Records whether Python's cyclic garbage collector runs while the passes do."""

    name = "test_collector_probe"

    def run(self, closed, config):
        import gc
        COLLECTOR.append(gc.isenabled())
        return super().run(closed, config)
