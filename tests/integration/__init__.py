"""Tests that need several megascale packages installed together (``nox -s integration``)."""
