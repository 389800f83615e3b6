"""The tests behind each chapter's graded exercises, one module per chapter.

``chNN.py`` holds the tests of ``solutions/NN_*_exercises.ipynb``, each registered
with ``@exercise("NN.name", points=...)`` from :mod:`ultrascale_grading`. A test
receives the learner's objects (the arguments given to ``check`` after the id),
compares what they compute with a reference, and raises ``AssertionError`` with a
message that helps the learner find the mistake. Tests never compare printed text.
"""
