"""The reliability tests import their case table and harness as plain modules from this folder; ``forwards``
counts the forwards of a test module's ``model`` fixture (a bad input must be refused before the first)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()
