"""Bad input to the verbs that load a model (``model-data``, ``solve --solver refine``, ``calibrate``, ``lm-eval``):
a device this machine lacks, a dtype that is none, a model folder polykv cannot load, an lm-eval model argument it
would not read. Each is one line naming the option, argument or folder, before any model loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cases import TINY, add, model_folder, profile_dict, write

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # lm-eval's local example tasks, never the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = str(Path(__file__).resolve().parents[2] / "examples" / "lm_eval_tasks")
DEVICES = [("cuda", "--device"), ("cuda-1", "--device"), ("tpu9", "--device"), ("meta", "--device"),
           ("mps", "--device"), ("empty", "--device")]
DEVICE_ARG = {"cuda": "cuda", "cuda-1": "cuda:1", "tpu9": "tpu9", "meta": "meta", "mps": "mps", "empty": ""}


def pickled_folder(d: Path) -> str:
    """A model folder whose weights are a pickled ``pytorch_model.bin`` (with config and nothing else)."""
    import torch

    from polykv.testing import tiny_model

    path = d / "pickled"
    model = tiny_model(**TINY)
    model.config.save_pretrained(str(path))
    torch.save(model.state_dict(), str(path / "pytorch_model.bin"))
    return str(path)


def weights_without_tokenizer(d: Path) -> str:
    from polykv.testing import tiny_model

    path = d / "no-tokenizer"
    tiny_model(**TINY).save_pretrained(str(path))
    return str(path)


# -- model-data ----------------------------------------------------------------------------------------
OUT = "x.qstats.safetensors"
for _id, _expect in DEVICES:
    add(f"verbs-model-data-device-{_id}", "cli", lambda d, i=_id: [
        "model-data", "default", "triattention", "-o", OUT, "--device", DEVICE_ARG[i]], _expect, (OUT,))
for _id, _dtype in (("float99", "float99"), ("int8", "int8"), ("fp8", "fp8")):
    add(f"verbs-model-data-dtype-{_id}", "cli", lambda d, t=_dtype: [
        "model-data", "default", "triattention", "-o", OUT, "--dtype", t], "--dtype", (OUT,))
MODEL_FOLDERS = [
    ("missing", lambda d: str(d / "nope"), "nope"),
    ("a-file", lambda d: write(d, "model.txt", "not a model"), "model.txt"),
    ("no-config", lambda d: (os.mkdir(d / "empty"), str(d / "empty"))[1], "config.json"),
    ("pickled-weights", pickled_folder, "pytorch_model.bin"),
    ("no-weights", lambda d: model_folder(d), "no weights"),
    ("no-tokenizer", weights_without_tokenizer, "tokenizer"),
]
for _id, _folder, _expect in MODEL_FOLDERS:
    add(f"verbs-model-data-folder-{_id}", "cli", lambda d, f=_folder: [
        "model-data", f(d), "triattention", "-o", OUT], _expect, (OUT,))
    add(f"verbs-calibrate-folder-{_id}", "cli", lambda d, f=_folder: [
        "calibrate", f(d), "-o", "x.profile.json", "--sequences", "1", "--tokens", "40", "--prefix", "16"], _expect,
        ("x.profile.json", "x.qstats.safetensors"))


# -- solve --solver refine -------------------------------------------------------------------------------
def _refine(d: Path, *extra: str) -> list[str]:
    return ["solve", write(d, "prof.json", profile_dict()), "--budget", "4x", "--context", "256", "-o",
            "out.plan.json", "--solver", "refine", *extra]


for _id, _expect in DEVICES:
    add(f"verbs-refine-device-{_id}", "cli", lambda d, i=_id: _refine(d, "--model", "default", "--device",
                                                                   DEVICE_ARG[i]), _expect, ("out.plan.json",))
add("verbs-refine-pickled-weights", "cli", lambda d: _refine(d, "--model", pickled_folder(d), "--tokens", "64"),
    "pytorch_model.bin",
    ("out.plan.json",))

# -- calibrate: the devices its check did not know --------------------------------------------------------
for _id in ("meta", "cuda-1", "empty"):
    add(f"verbs-calibrate-device-{_id}", "cli", lambda d, i=_id: [
        "calibrate", model_folder(d), "-o", "x.profile.json", "--device", DEVICE_ARG[i]], "--device",
        ("x.profile.json", "x.qstats.safetensors"))


# -- lm-eval's model arguments ------------------------------------------------------------------------------
def _lm_eval(model_args: str, *extra: str) -> list[str]:
    return ["lm-eval", "--model", "polykv", "--model_args", model_args, "--tasks", "polykv_secret_word",
            "--include_path", TASKS, "--limit", "1", *extra]


SHIPPED_STATS_PLAN = Path(TASKS).parents[1] / "plans" / "smollm2-135m-instruct.quant-only-triattention.4x.plan.json"


def _plan_reading_stats(d: Path) -> str:
    """The shipped TriAttention plan without its model_data field: it reads query statistics beside a profile."""
    plan = json.loads(SHIPPED_STATS_PLAN.read_text(encoding="utf-8"))
    del plan["model_data"]
    return write(d, "stats.plan.json", plan)


LM_EVAL = [
    ("dtype-float99", lambda d: _lm_eval("pretrained=default,dtype=float99"), "dtype"),
    ("dtype-int8", lambda d: _lm_eval("pretrained=default,dtype=int8"), "dtype"),
    ("unknown-arg", lambda d: _lm_eval("pretrained=default,colour=red"), "colour"),
    ("unknown-hf-arg", lambda d: _lm_eval("pretrained=default,trust_remote_code=True"), "trust_remote_code"),
    ("pretrained-missing", lambda d: _lm_eval(f"pretrained={d / 'nonexistent'}"), "no such folder"),
    ("pretrained-pickled", lambda d: _lm_eval(f"pretrained={pickled_folder(d)}"), "pytorch_model.bin"),
    ("pretrained-no-config", lambda d: (os.mkdir(d / "empty"), _lm_eval(f"pretrained={d / 'empty'}"))[1],
     "config.json"),
    ("device-tpu9", lambda d: _lm_eval("pretrained=default,device=tpu9"), "device"),
    ("device-meta", lambda d: _lm_eval("pretrained=default,device=meta"), "device"),
    ("cli-device-tpu9", lambda d: _lm_eval("pretrained=default", "--device", "tpu9"), "device"),
    ("profile-missing", lambda d: _lm_eval(f"pretrained=default,profile={d / 'none.profile.json'}"),
     "none.profile.json"),
    ("profile-unread", lambda d: _lm_eval(f"pretrained=default,profile={write(d, 'p.profile.json', profile_dict())}"),
     "p.profile.json"),
    ("profile-without-side-file", lambda d: _lm_eval(
        f"pretrained=default,plan={_plan_reading_stats(d)},profile={write(d, 'q.profile.json', profile_dict())}"),
     "qstats"),
    ("profile-with-plan-naming-its-data", lambda d: _lm_eval(
        f"pretrained=default,plan={SHIPPED_STATS_PLAN},profile={write(d, 'q.profile.json', profile_dict())}"),
     "q.profile.json"),
    ("batch-size-2", lambda d: _lm_eval("pretrained=default,batch_size=2"), "batch_size"),
]
for _id, _setup, _expect in LM_EVAL:
    add(f"verbs-lm-eval-{_id}", "cli", _setup, _expect)
