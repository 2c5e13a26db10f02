"""Bad input at the seams where plugin-owned code meets the core: the token-blocks view a store returns, the
fused kernel a view offers, a rule's declared per-model data, and the 0.1 names of that data.

Each refusal is one line of a ValueError (the view and kernel math) or polykv's own error, naming the thing
and what to do; nothing falls back to another backend without being asked."""

from __future__ import annotations

import pytest
import torch

import polykv.contract as contract
from polykv.attention.online_softmax import attend_stores, decode_attention_from_stores
from polykv.contract import storage
from polykv.contract.model_data import need_of, recognises
from polykv.registry import get_registry


def _sixteen_bit(T=5, d=8):
    store = storage.PassthroughStore(dtype=torch.float32, device="cpu")
    store.append(torch.randn(1, 1, T, d, generator=torch.Generator().manual_seed(T)))
    return store


@pytest.mark.parametrize("lengths, field", [
    (torch.tensor([[9]]), "residual_len"),          # more rows than the view holds
    (torch.tensor([[-1]]), "residual_len"),         # negative
    (torch.tensor([[1.5]]), "residual_len"),        # not integers
    (torch.tensor([[1, 2]]), "residual_len"),       # another head count
])
def test_a_view_with_impossible_head_counts_is_refused_naming_the_field(lengths, field):
    with pytest.raises(ValueError, match=rf"^packed stream: {field} must be \[1, 1\] integers in \[0, 5\]$"):
        storage.TokenRows(residual=torch.zeros(1, 1, 5, 8), residual_len=lengths)


def test_a_view_without_codes_refuses_to_dequantize_code_rows():
    view = _sixteen_bit().token_blocks()
    assert view.codes is None and view.num_quantized == 0
    with pytest.raises(ValueError, match=r"^TokenRows holds no code rows \(rows 0\.\.1 asked\)$"):
        view.dequantize_rows(0, 2)


def test_the_fused_backend_on_two_sixteen_bit_stores_is_refused_not_replaced():
    query = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"^the token blocks of PassthroughStore and PassthroughStore offer no fused "
                                         r"kernel; use backend='blockwise'$"):
        attend_stores(query, _sixteen_bit(), _sixteen_bit(), scaling=0.5, backend="fused")
    # the runtime's own call has no kernel to choose here: it reads the blocks, as blockwise does
    torch.testing.assert_close(decode_attention_from_stores(query, _sixteen_bit(), _sixteen_bit(), scaling=0.5),
                               attend_stores(query, _sixteen_bit(), _sixteen_bit(), scaling=0.5))


@pytest.mark.parametrize("content", [b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-json", b"", b"{}"])
def test_a_foreign_file_is_not_recognised_as_a_rules_data(tmp_path, content):
    path = tmp_path / "x.qstats.safetensors"
    path.write_bytes(content)
    registry = get_registry()
    for name in ("triattention", "kvzip-head"):
        need = need_of(registry.rule(name))
        assert recognises(need, str(path)) is False, name


@pytest.mark.parametrize("name, home", [
    ("QueryStats", "polykv.adapters.rules.query_stats"),
    ("compute_query_stats", "polykv.adapters.rules.query_stats"),
    ("QUERY_STATS_SUFFIX", "polykv.adapters.rules.query_stats"),
    ("HeadScores", "polykv.adapters.rules.kvzip_heads"),
    ("HEAD_SCORES_SUFFIX", "polykv.adapters.rules.kvzip_heads"),
])
def test_a_0_1_name_of_a_rules_data_resolves_in_its_plugin_with_a_warning(name, home):
    with pytest.warns(DeprecationWarning, match=rf"^polykv.contract.{name} left the plugin contract's front door in "
                                                rf"0.2; import it from {home} "):
        value = getattr(contract, name)
    assert value is getattr(__import__(home, fromlist=[name]), name)
