"""The reliability tests import their case table and harness as plain modules from this folder."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
