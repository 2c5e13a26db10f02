"""The kivi quantizer as a plugin: registered, declared widths, parameter and shape errors."""

import pytest
import torch

from polykv.adapters.quantizers import QUANTIZERS
from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.adapters.quantizers.kivi_keys import KiviKeyStore
from polykv.adapters.quantizers.kivi_values import KiviValueStore
from polykv.registry import Registry


def test_registered_through_the_plugin_hook():
    reg = Registry(load_entry_points=False)
    assert reg.quantizer("kivi") is KiviQuantizer
    assert reg.entry("quantizer", "kivi").plugin == "polykv.adapters.quantizers"
    assert KiviQuantizer in QUANTIZERS
    assert KiviQuantizer.bits == frozenset({2, 4, 8})
    assert "2402.02750" in KiviQuantizer.paper


def test_new_store_builds_the_stream_store():
    q = KiviQuantizer(group_size=8, residual=16)
    k = q.new_store("key", 4, dtype=torch.float32, device="cpu")
    v = q.new_store("value", 2, dtype=torch.float32, device="cpu")
    assert isinstance(k, KiviKeyStore) and (k.bits, k.group_size, k.residual_len) == (4, 8, 16)
    assert isinstance(v, KiviValueStore) and (v.bits, v.group_size, v.residual_len) == (2, 8, 16)


@pytest.mark.parametrize("params,match", [
    ({"group_size": 32, "residual": 48}, "multiple of group_size"),
    ({"group_size": 0}, "parameter 'group_size' must be >= 1"),
    ({"residual": 2.5}, "parameter 'residual' must be an integer"),
    ({"block": 4}, "no parameter"),
])
def test_bad_parameters_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        KiviQuantizer(**params)


def test_bad_stream_or_width():
    q = KiviQuantizer()
    with pytest.raises(ValueError, match="stores \\[2, 4, 8\\] bits"):
        q.new_store("key", 3, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="unknown stream"):
        q.predict_bytes("query", 4, batch=1, kv_heads=1, head_dim=64, tokens=1, dtype_bytes=2)


def test_head_dim_must_hold_whole_value_groups():
    q = KiviQuantizer()  # group_size 32
    store = q.new_store("value", 4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="group_size to a divisor of 16"):
        store.append(torch.randn(1, 1, 4, 16))
    with pytest.raises(ValueError, match="divisor of 16"):
        q.predict_bytes("value", 4, batch=1, kv_heads=1, head_dim=16, tokens=4, dtype_bytes=2)
