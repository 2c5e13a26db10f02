"""The study runner feeds what the prompt rule builds: the BOS is the first stored token, StreamingLLM's
sinks keep it, the question never carries a second one, and the setting is part of the resume key."""

from __future__ import annotations

import json

import pytest

from polykv.errors import StudyError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec, uniform_plan
from polykv.runtime import answer as protocol
from polykv.studies.report import prompt_line
from polykv.studies.results import Results, ResultsWriter
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec
from polykv.testing import tiny_model

BOS = 1
TINY = {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 262}
PASSKEY = {"task": "passkey", "params": {"length": 320, "digits": 3, "max_new_tokens": 2}, "samples": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_model(**TINY)


@pytest.fixture
def spec_file(tmp_path, model):
    plan = tmp_path / "sink.json"
    uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="streamingllm", capacity=24,
                                                          params={"n_sink": 4})).save(str(plan))

    def write(**fields) -> str:
        spec = {"name": "bos", "model": {"tiny": TINY}, "context_tokens": 320, "plans": {"sink": "sink.json"},
                "tasks": [PASSKEY], **fields}
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        return str(path)
    return write


def _run(spec_path, results, model, tokenizer, monkeypatch, reuse: bool = True):
    """Run the study, recording per (policy, item) the first context id, the stored positions of every
    layer right after compression, and the question ids fed through the compressed cache."""
    seen = {"ctx": [], "positions": [], "question": []}
    compress, greedy = protocol.compress_context, protocol.generate_answer

    def spy_compress(session, ctx, snap, chunk_size):
        kv = compress(session, ctx, snap, chunk_size)
        seen["ctx"].append(ctx[0].tolist())
        seen["positions"].append([layer.positions[0].tolist() for layer in session.cache.layers])
        return kv

    def spy_greedy(session, question, max_new_tokens, stop, done=None):
        seen["question"].append(question[0].tolist())
        return greedy(session, question, max_new_tokens, stop, done)

    monkeypatch.setattr(protocol, "compress_context", spy_compress)
    monkeypatch.setattr(protocol, "generate_answer", spy_greedy)
    spec = load_spec(spec_path)
    run_study(prepare(spec, results), model=model, tokenizer=tokenizer, progress=False)
    return seen


@pytest.mark.parametrize("reuse", [True, False])
def test_the_bos_is_stored_first_and_streamingllm_keeps_it_as_a_sink(tmp_path, spec_file, model, make_tokenizer,
                                                                     monkeypatch, reuse):
    tok = make_tokenizer(adds_bos=True)
    results = str(tmp_path / "results.jsonl")
    seen = _run(spec_file(reuse_prefill=reuse), results, model, tok, monkeypatch)
    assert len(seen["ctx"]) == 4                                   # full and sink x 2 items
    for ctx, positions, question in zip(seen["ctx"], seen["positions"], seen["question"]):
        assert ctx[0] == BOS and ctx.count(BOS) == 1
        assert BOS not in question and question == tok.encode(PASSKEY_QUESTION, add_special_tokens=False)
        for heads in positions:                                    # every layer, every KV head
            for pos in heads:
                assert pos[0] == 0                                 # position 0 (the BOS) is stored first
    sink = [p for p, c in zip(seen["positions"], seen["ctx"]) if len(p[0][0]) < len(c)]
    assert len(sink) == 2 and all(len(heads) == 24 and heads[:4] == [0, 1, 2, 3] for p in sink for heads in p[0])
    res = Results.load(results)
    assert all(r["bos_first"] for r in res.results)
    assert res.header["spec"]["bos"] == "auto" and res.header["spec"]["prompt_format"] == "plain"
    assert prompt_line(res) == ("Prompt: `plain` format, `bos`: `auto`; the first stored token is the tokenizer's "
                                "BOS in 2 of 2 items.")


def test_bos_false_stores_the_text_first(tmp_path, spec_file, model, make_tokenizer, monkeypatch):
    tok = make_tokenizer(adds_bos=True)
    results = str(tmp_path / "results.jsonl")
    seen = _run(spec_file(bos=False), results, model, tok, monkeypatch)
    assert all(BOS not in ctx for ctx in seen["ctx"]) and all(BOS not in q for q in seen["question"])
    res = Results.load(results)
    assert not any(r["bos_first"] for r in res.results)
    assert "`bos`: `false`; the first stored token is the tokenizer's BOS in 0 of 2 items" in prompt_line(res)


def test_bos_true_adds_one_where_the_tokenizer_does_not(tmp_path, spec_file, model, make_tokenizer, monkeypatch):
    tok = make_tokenizer(adds_bos=False)
    seen = _run(spec_file(bos=True), str(tmp_path / "r.jsonl"), model, tok, monkeypatch)
    assert all(ctx[0] == BOS and ctx.count(BOS) == 1 for ctx in seen["ctx"])


def test_chat_prompts_feed_the_turn_end_and_assistant_header_after_compression(tmp_path, spec_file, model,
                                                                                make_tokenizer, monkeypatch):
    tok = make_tokenizer(adds_bos=True, chat=True)
    seen = _run(spec_file(prompt_format="chat"), str(tmp_path / "r.jsonl"), model, tok, monkeypatch)
    tail = tok.encode("<|end|>\n<|assistant|>\n", add_special_tokens=False)
    head = tok.encode("<s><|user|>\n", add_special_tokens=False)
    for ctx, question in zip(seen["ctx"], seen["question"]):
        assert ctx[:len(head)] == head and question[-len(tail):] == tail and BOS not in question


def test_the_setting_is_part_of_the_resume_key(tmp_path, spec_file, model, make_tokenizer, monkeypatch):
    hashes = {(bos, fmt): load_spec(spec_file(bos=bos, prompt_format=fmt)).hash
              for bos in ("auto", True, False) for fmt in ("plain", "chat")}
    assert len(set(hashes.values())) == 6
    assert load_spec(spec_file()).hash == hashes[("auto", "plain")]          # the defaults
    results = str(tmp_path / "results.jsonl")
    _run(spec_file(), results, model, make_tokenizer(adds_bos=True), monkeypatch)
    with pytest.raises(StudyError, match="belongs to another study"):
        ResultsWriter.check(results, load_spec(spec_file(bos=False)).hash)
    again = run_study(prepare(load_spec(spec_file()), results), model=model, tokenizer=make_tokenizer(adds_bos=True),
                      progress=False)
    assert again == {"run": 0, "skipped": 4}


def test_spec_errors_name_the_field(spec_file):
    with pytest.raises(StudyError, match="field 'bos': expected \"auto\", true or false"):
        load_spec(spec_file(bos="yes"))
    with pytest.raises(StudyError, match="field 'prompt_format'"):
        load_spec(spec_file(prompt_format="instruct"))
    cont = {"task": "continuation", "params": {"context_tokens": 100, "continuation_tokens": 20}, "samples": 1}
    with pytest.raises(StudyError, match="field 'prompt_format': task 'continuation' is teacher_forced"):
        load_spec(spec_file(prompt_format="chat", tasks=[cont]))


PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
