"""``use_cache=False`` and calls from several threads: served exactly, or refused in one line.

Without a cache a generate recomputes the whole sequence each step; the keep-everything plan then
gives vanilla's tokens, and a compressing plan (nothing to compress) is refused. A session holds one
cache, so a second thread's call while another runs is refused; calls serialised by a lock work.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessorList

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model
from polykv.runtime.cache import cache_keyword

TOL = 1e-4
NEW = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _full(model):
    return polykv.full_plan(geometry_of_model(model))


def _snapkv(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=8)


@pytest.mark.parametrize("batch", [1, 2])
def test_uncached_generate_under_the_full_plan_equals_vanilla(model, prompt, batch):
    ids = prompt(batch, 12, seed=batch)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, use_cache=False, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with polykv.apply(model, _full(model)) as session:
            got = model.generate(ids, **kwargs)
            stored = session.cache.stored_tokens()
    assert torch.equal(got.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores)) < TOL
    # the last forward recomputed the sequence from scratch: it holds that sequence once, not every step's copy
    assert stored == [12 + NEW - 1] * 2


def test_a_checkpoint_whose_generation_config_says_no_cache_is_served_the_same(model, prompt):
    ids = prompt(1, 12, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=False)
        saved = model.generation_config.use_cache
        model.generation_config.use_cache = False
        try:
            with polykv.apply(model, _full(model)) as session:
                got = model.generate(ids, max_new_tokens=NEW, do_sample=False)
                stored = session.cache.stored_tokens()
        finally:
            model.generation_config.use_cache = saved
    assert torch.equal(got, ref)
    assert stored == [12 + NEW - 1] * 2


def test_uncached_generate_under_a_compressing_plan_is_refused(model, prompt):
    ids = prompt(1, 12, seed=4)
    with torch.no_grad(), polykv.apply(model, _snapkv(model)):
        with pytest.raises(RuntimeConfigError, match=r"use_cache=False.*nothing to compress.*use_cache=True") as info:
            model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=False)
        assert "\n" not in str(info.value)
        saved = model.generation_config.use_cache
        model.generation_config.use_cache = False
        try:
            with pytest.raises(RuntimeConfigError, match=r"generation_config\.use_cache = True"):
                model.generate(ids, max_new_tokens=NEW, do_sample=False)
        finally:
            model.generation_config.use_cache = saved
        # an explicit use_cache=True overrides the checkpoint's setting and compresses as usual
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=True)
    assert out.shape == (1, 12 + NEW)


def test_uncached_generate_with_a_cache_is_refused(model, prompt):
    ids = prompt(1, 12, seed=5)
    with torch.no_grad(), polykv.apply(model, _full(model)) as session:
        with pytest.raises(RuntimeConfigError, match=r"got a cache and use_cache=False"):
            model.generate(ids, max_new_tokens=2, use_cache=False, **{cache_keyword(model): session.new_cache()})


def test_a_bare_forward_without_a_cache_is_refused_and_with_one_matches_vanilla(model, prompt):
    ids = prompt(1, 12, seed=6)
    with torch.no_grad():
        from transformers import DynamicCache

        ref_cache = DynamicCache(config=model.config)
        ref = [model(ids[:, :11], use_cache=False, **{cache_keyword(model): ref_cache}).logits,
               model(ids[:, 11:], use_cache=False, **{cache_keyword(model): ref_cache}).logits]
        with polykv.apply(model, _full(model)) as session:
            with pytest.raises(RuntimeConfigError, match=r"use_cache=True"):
                model(ids, use_cache=False)
            cache = session.new_cache()
            got = [model(ids[:, :11], use_cache=False, **{cache_keyword(model): cache}).logits,
                   model(ids[:, 11:], use_cache=False, **{cache_keyword(model): cache}).logits]
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < TOL


class _Pause:
    """A logits processor that holds its generate inside the session until released."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        self.inside.set()
        assert self.release.wait(60)
        return scores


@pytest.mark.parametrize("second", ["generate", "prefill", "forward", "new_cache"])
def test_a_second_thread_is_refused_while_a_generate_runs(model, prompt, second):
    ids = prompt(1, 12, seed=7)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    pause, result, refusal = _Pause(), {}, {}

    def first():
        with torch.no_grad():
            result["out"] = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                           logits_processor=LogitsProcessorList([pause]))

    def other(session):
        assert pause.inside.wait(60)
        try:
            with torch.no_grad():
                if second == "generate":
                    model.generate(ids, max_new_tokens=NEW, do_sample=False)
                elif second == "prefill":
                    session.prefill(ids)
                elif second == "forward":
                    model(ids, **{cache_keyword(model): session.cache}, use_cache=True)
                else:
                    session.new_cache()
        except RuntimeConfigError as exc:
            refusal["error"] = str(exc)
        finally:
            pause.release.set()

    with polykv.apply(model, _full(model)) as session:
        threads = [threading.Thread(target=first), threading.Thread(target=other, args=(session,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert "second thread" in refusal["error"] and "one generate/prefill/forward at a time" in refusal["error"]
    assert "own model copy and polykv.apply session" in refusal["error"] and "\n" not in refusal["error"]
    assert torch.equal(result["out"], ref)  # the running generate was not disturbed


def test_threads_that_take_turns_share_a_session(model, prompt):
    prompts = [prompt(1, 10, seed=20 + i) for i in range(5)]
    with torch.no_grad():
        refs = [model.generate(p, max_new_tokens=NEW, do_sample=False) for p in prompts]
    lock, outs, errors = threading.Lock(), {}, []

    def run(i):
        try:
            with lock, torch.no_grad():
                outs[i] = model.generate(prompts[i], max_new_tokens=NEW, do_sample=False)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with polykv.apply(model, _full(model)):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors
    assert all(torch.equal(outs[i], refs[i]) for i in range(5))
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__  # restored on exit


def test_a_failed_call_releases_the_session(model, prompt):
    ids = prompt(1, 12, seed=8)
    with torch.no_grad(), polykv.apply(model, _full(model)) as session:
        with pytest.raises(Exception):
            model(ids, **{cache_keyword(model): session.new_cache()}, use_cache=True, attention_mask=torch.zeros(1, 12))
        errors = []

        def run():
            try:
                with torch.no_grad():
                    session.prefill(ids)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    assert not errors
