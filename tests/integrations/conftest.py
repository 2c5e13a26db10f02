"""Shared set-up of the integration tests: a tiny study spec and a local Ray started by the tests."""

from __future__ import annotations

import json
import os

import pytest

TINY = {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 128, "seed": 0}
TIMING = {"seconds", "prefill_seconds"}
"""Result fields that measure wall time: the only ones two equivalent runs may differ in."""


def write_tiny_spec(folder, *, passkey_samples: int = 3, continuation_samples: int = 2) -> str:
    """A study over a 2-layer random model: full, two plan files; passkey (generated) and continuation
    (teacher-forced) items."""
    from polykv.geometry import geometry_of_model
    from polykv.plan import uniform_plan
    from polykv.testing import tiny_model

    geo = geometry_of_model(tiny_model(**TINY))
    uniform_plan(geo, prefill="snapkv", capacity=48).save(os.path.join(folder, "snapkv.json"))
    uniform_plan(geo, prefill="h2o", decode="h2o", capacity=40, k_bits=8, v_bits=4,
                 decode_slack=4).save(os.path.join(folder, "h2o.json"))
    spec = {"name": "tiny-ray", "model": {"tiny": TINY}, "context_tokens": 300,
            "plans": {"snapkv": "snapkv.json", "h2o": "h2o.json"},
            "tasks": [{"task": "passkey", "params": {"length": 300, "digits": 3, "max_new_tokens": 3},
                       "samples": passkey_samples, "seed": 0},
                      {"task": "continuation", "params": {"context_tokens": 160, "continuation_tokens": 40},
                       "samples": continuation_samples, "seed": 0}]}
    path = os.path.join(folder, "spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    return path


def comparable(records: list[dict]) -> list[str]:
    """Every record of a results file without its wall times, as sorted JSON lines."""
    return sorted(json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True) for r in records)


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with 2 CPUs for the whole test session (started here, shut down after)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_spec():
    """``tiny_spec(folder, passkey_samples=3, continuation_samples=2)`` -> path of a tiny study spec."""
    return write_tiny_spec


@pytest.fixture(scope="session")
def same_records():
    """``same_records(a, b)``: the two record lists are equal apart from wall times (order aside)."""
    return lambda a, b: comparable(a) == comparable(b)
