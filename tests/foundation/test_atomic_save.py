"""Plan.save is atomic: a write that fails part-way leaves the previous file intact and no debris."""

from __future__ import annotations

import attrs
import pytest

from polykv.models.geometry import ModelGeometry
from polykv.plan import Provenance, load_plan, uniform_plan

GEO = ModelGeometry(model_type="llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4)


def _old_and_new():
    old = uniform_plan(GEO, prefill="tova", capacity=32)
    # A lone surrogate passes json.dumps(ensure_ascii=False) but cannot be encoded as UTF-8: the write
    # itself fails, after the temporary file was created and partly written.
    new = attrs.evolve(uniform_plan(GEO, prefill="h2o", capacity=64), provenance=Provenance(note="bad \ud800"))
    return old, new


def test_failed_write_leaves_the_old_file_intact(tmp_path):
    old, new = _old_and_new()
    path = tmp_path / "plan.json"
    old.save(str(path))
    before = path.read_bytes()
    with pytest.raises(UnicodeEncodeError):
        new.save(str(path))
    assert path.read_bytes() == before
    assert load_plan(str(path)) == old
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"], "a temporary file was left behind"


def test_failed_rename_leaves_the_target_and_no_debris(tmp_path):
    old, _ = _old_and_new()
    target = tmp_path / "plan.json"
    target.mkdir()  # the final rename onto a directory fails
    (target / "keep.txt").write_text("untouched")
    with pytest.raises(OSError):
        old.save(str(target))
    assert (target / "keep.txt").read_text() == "untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_save_replaces_and_creates_folders(tmp_path):
    old, _ = _old_and_new()
    path = tmp_path / "deep" / "er" / "plan.json"
    old.save(str(path))
    changed = old.with_layer(1, k_bits=8)
    changed.save(str(path))
    assert load_plan(str(path)) == changed
    assert path.read_text(encoding="utf-8") == changed.to_json()


def test_replacement_keeps_permissions_and_new_files_follow_the_umask(tmp_path):
    import os
    import stat

    from polykv.atomic import replace_with

    def private_writer(tmp):  # what safetensors' writer does: a 0o600 file
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x")
        os.close(fd)

    mask = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.safetensors"
        replace_with(str(fresh), private_writer)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        kept = tmp_path / "kept.safetensors"
        kept.write_bytes(b"old")
        os.chmod(kept, 0o640)
        replace_with(str(kept), private_writer)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_bytes() == b"x"
    finally:
        os.umask(mask)
