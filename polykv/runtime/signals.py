"""Attention signals for rules: the chunked attention math, now shared with rule states.

The helpers live in :mod:`polykv.rule_state` (a bottom module, so that rules, calibration and the
runtime use one implementation); this module keeps the runtime's import path.
"""

from polykv.rule_state import attention_column_sums, attention_probabilities, lower_right_causal

__all__ = ["attention_column_sums", "attention_probabilities", "lower_right_causal"]
