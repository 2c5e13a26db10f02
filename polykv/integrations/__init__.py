"""Connections to the tools researchers already use: lm-evaluation-harness (:mod:`.lm_harness`) and the
transformers pipeline task ``polykv-text-generation`` (:mod:`.pipeline`: the context compressed, then each
question asked).

Studies on Ray live with the studies (:mod:`polykv.studies.distributed`); Hugging Face ``generate`` and
the plain ``pipeline`` need no adapter (``with polykv.apply(model, plan):``). Nothing below the studies imports
this package, and ``lm_eval`` is imported only when its module is.
"""
