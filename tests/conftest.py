"""Settings for every test module (loaded before them).

Hypothesis's default 200 ms deadline a example is a timed assert: on a shared,
noisy machine a stall fails a test that asserts nothing about time (the
project never asserts timings in tests; speed lives in ``benchmarks/``). So no
example has a deadline here; each test's own settings still choose its examples.
"""

from hypothesis import settings

settings.register_profile("iop-trio", deadline=None)
settings.load_profile("iop-trio")
