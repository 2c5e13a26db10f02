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
    from polykv.models.geometry import geometry_of_model
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
def tiny_spec():
    """``tiny_spec(folder, passkey_samples=3, continuation_samples=2)`` -> path of a tiny study spec."""
    return write_tiny_spec


@pytest.fixture(scope="session")
def same_records():
    """``same_records(a, b)``: the two record lists are equal apart from wall times (order aside)."""
    return lambda a, b: comparable(a) == comparable(b)


CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory):
    """A local Hugging Face model folder: a 2-layer random Llama and a character-level fast tokenizer
    (BOS/EOS/pad specials), loadable with ``from_pretrained`` and by lm-eval's ``hf`` model, offline."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from polykv.testing import tiny_model

    folder = tmp_path_factory.mktemp("tiny-hf")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(CHARS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(str(folder))
    model = tiny_model(layers=2, heads=4, kv_heads=2, head_dim=32, vocab=len(vocab), seed=1)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 0
    model.generation_config.eos_token_id = 2
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="session")
def lm_eval_tasks(tmp_path_factory):
    """A folder of two local lm-eval tasks over JSONL files written here: ``polykv_tiny_gen``
    (generate_until, exact match) and ``polykv_tiny_choice`` (multiple choice: loglikelihood, acc)."""
    import random

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    rng = random.Random(0)
    words = ["amber", "falcon", "garden", "harbor", "kettle", "meadow", "rocket", "violin", "walnut", "zipper"]

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    gen = [{"prompt": f"Notes: {text(24)}\nThe word to repeat is {w}. Repeat it:", "answer": f" {w}"}
           for w in words[:4]]
    choice = [{"prompt": f"Story: {text(24)}\nThe story mentions", "choices": [f" {a}", f" {b}", f" {c}"],
               "label": i % 3} for i, (a, b, c) in enumerate(zip(words, words[3:], words[6:]))][:4]
    for name, rows in (("gen", gen), ("choice", choice)):
        with open(folder / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    (folder / "polykv_tiny_gen.yaml").write_text(f"""task: polykv_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    (folder / "polykv_tiny_choice.yaml").write_text(f"""task: polykv_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return str(folder)
