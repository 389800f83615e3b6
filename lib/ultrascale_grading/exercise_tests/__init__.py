"""The tests behind the graded exercises, in modules named for their chapter.

``chNN.py`` holds the tests of ``solutions/NN_*_exercises.ipynb``, each registered
with ``@exercise("NN.name", points=...)`` from :mod:`ultrascale_grading`; where they would be
longer than the technique they grade, some of a chapter's exercises are in ``chNN_<part>.py``
(``ch06_ring_step.py``), which the registry imports with the chapter. A test
receives the learner's objects (the arguments given to ``check`` after the id),
compares what they compute with a reference, and raises ``AssertionError`` with a
message that helps the learner find the mistake. Tests never compare printed text.
"""
