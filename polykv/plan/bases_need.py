"""The per-model data a plan itself declares: the key/value bases its ranks (``k_rank`` / ``v_rank``) read.

A rule declares the data it needs on its class (:mod:`polykv.contract.model_data`); a plan with ranks needs the
model's key/value bases (:mod:`polykv.models.kv_bases`), found, checked or computed the same way.
"""

from __future__ import annotations

from polykv.contract.model_data import ModelDataNeed
from polykv.models.kv_bases import KV_BASES_KEY, KV_BASES_SUFFIX, KVBases, check_bases_of, compute_kv_bases

KV_BASES_NEED = ModelDataNeed(key=KV_BASES_KEY, suffix=KV_BASES_SUFFIX, compute=compute_kv_bases, load=KVBases.load,
                              check=check_bases_of, description="key/value bases")
"""The bases as per-model data a plan with ranks declares (found, checked or computed like a rule's data)."""
