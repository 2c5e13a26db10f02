"""Side files a plan names (field ``model_data``) through the CLI: `plan validate` and `study --check` open and
check every one, and refuse a missing, non-regular, foreign or damaged file in one line naming the field and path."""

from __future__ import annotations

import os

from cases import _study, add, spec_dict, write
from cases_kvzip import _head_plan   # both layers kvzip-head in one group (the tiny plan: 2 layers, 2 KV heads)


def _scores(d, name: str = "s.kvzip-heads.safetensors", *, values=None, shape=(2, 2)) -> str:
    """A head-score file written as raw tensors (bypassing HeadScores' own checks, as a damaged file would)."""
    import torch
    from safetensors.torch import save_file

    from polykv.adapters.rules.kvzip_heads import FORMAT, FORMAT_VERSION

    scores = values if values is not None else torch.rand(*shape)
    save_file({"scores": scores.contiguous()}, str(d / name),
              metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION),
                        "fingerprint": "cfg-000000000000+s-000000000000", "num_tokens": "8"})
    return name


def _validate(d, model_data: dict) -> list[str]:
    return ["plan", "validate", write(d, "p.json", _head_plan(model_data=model_data))]


def _dangling(d) -> str:
    os.symlink(str(d / "gone.kvzip-heads.safetensors"), str(d / "link.kvzip-heads.safetensors"))
    return "link.kvzip-heads.safetensors"


def _fifo(d) -> str:
    os.mkfifo(str(d / "f.kvzip-heads.safetensors"))
    return "f.kvzip-heads.safetensors"


def _nan(d) -> str:
    import torch

    return _scores(d, values=torch.tensor([[0.5, float("nan")], [0.1, 0.2]]))


def _int(d) -> str:
    import torch

    return _scores(d, values=torch.ones(2, 2, dtype=torch.int32))


SETUPS = {
    "missing": lambda d: "absent.kvzip-heads.safetensors",
    "dangling-symlink": _dangling,
    "fifo": _fifo,
    "folder": lambda d: (os.mkdir(str(d / "dir.safetensors")), "dir.safetensors")[1],
    "etc-passwd": lambda d: "../" * 12 + "etc/passwd",
    "proc-environ": lambda d: "/proc/self/environ",
    "nan-scores": _nan,
    "int-scores": _int,
    "wrong-layers": lambda d: _scores(d, shape=(3, 2)),
    "wrong-kv-heads": lambda d: _scores(d, shape=(2, 4)),
}
for _id, _setup in SETUPS.items():
    add(f"sidefile-{_id}", "plan", lambda d, s=_setup: _validate(d, {"kvzip-head": s(d)}), "model_data.kvzip-head")

# an empty key is named as the key, not blamed on the path
add("sidefile-empty-key", "plan", lambda d: _validate(d, {"": _scores(d)}), "key is empty")

# study --check opens every plan's side files, naming the policy and field
add("sidefile-study-check-missing", "spec", lambda d: _study(
    d, dict(spec_dict(), baseline=False), plan=_head_plan(model_data={"kvzip-head": "absent.kvzip-heads.safetensors"})),
    "model_data.kvzip-head")
add("sidefile-study-check-nan", "spec", lambda d: _study(
    d, dict(spec_dict(), baseline=False), plan=_head_plan(model_data={"kvzip-head": _nan(d)})), "model_data.kvzip-head")
