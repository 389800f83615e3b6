"""Helpers of tests/test_browser.py: the course's JupyterLab, a headless Chromium, a learner at the page."""
