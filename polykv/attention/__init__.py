"""Attention math shared by the runtime, the rule states and calibration; it knows no plan or store.

- :mod:`polykv.attention.online_softmax` — attention over blocks of stored tokens (online softmax),
  reading a store's token-blocks view;
- :mod:`polykv.attention.signals` — softmax attention rows in query chunks and the signals rule
  states read from them (column sums, newest rows);
"""
