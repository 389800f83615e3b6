"""ultrascale: the shared library of the Ultra-Scale Playbook course.

One module per idea: ``runtime`` (persistent ranks beside a notebook), ``comm``
(collectives from send/recv, a communication logger, bandwidth and cost models),
``model``, ``memory``, ``kernels``, ``viz`` and ``grading``.
"""

__version__ = "0.1.0"
