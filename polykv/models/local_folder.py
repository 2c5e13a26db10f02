"""Loading a model by what a user types: ``default``, a model name (``gemma3-270m``) or a local Hugging Face folder.

Every verb that loads weights (``calibrate``, ``solve --solver refine``, ``model-data``, the lm-eval model) goes
through :func:`load_by_name`, so a folder is checked the same way everywhere before transformers reads it: it
exists, holds a readable ``config.json``, safetensors weights (pickled ``pytorch_model.bin`` weights are refused:
unpickling runs code) and a tokenizer. Models are never downloaded.
"""

from __future__ import annotations

import glob
import os

import torch

from polykv.errors import PolykvError
from polykv.models.loading import MODEL_ALIASES, NAMED_MODELS, load_default_model, load_model, read_local_config

FOLDER_HOLDS = "a folder holding a Hugging Face model (config.json, safetensors weights, tokenizer)"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_model_name(name) -> bool:
    """Whether ``name`` is ``default`` or a model polykv loads by name (not a folder)."""
    return isinstance(name, str) and (name == "default" or name in NAMED_MODELS or name in MODEL_ALIASES)


def check_model_folder(name: str, *, error: type[PolykvError] = PolykvError, weights: bool = False) -> None:
    """Refuse, in one ``error`` line naming the folder, a model that is neither a name nor a usable local folder.

    ``weights=True`` also checks what loading needs beyond the config: safetensors weights and a tokenizer."""
    if not os.path.isdir(name):
        what = "no such folder" if not os.path.lexists(name) else "not a folder"
        raise error(f"model {name!r}: {what}, and not 'default' or a model name ({', '.join(sorted(NAMED_MODELS))}); "
                    f"give {FOLDER_HOLDS} (models are never downloaded)")
    if not os.path.lexists(os.path.join(name, "config.json")):
        raise error(f"model {name!r}: the folder holds no config.json; give {FOLDER_HOLDS}")
    try:
        read_local_config(name)
    except PolykvError as exc:
        raise error(f"model {name!r}: {exc}") from None
    if not weights:
        return
    if not glob.glob(os.path.join(glob.escape(name), "*.safetensors")):
        pickled = sorted(os.path.basename(p) for pat in PICKLED for p in glob.glob(os.path.join(glob.escape(name), pat)))
        if pickled:
            raise error(f"model {name!r}: the weights are pickled ({', '.join(pickled[:3])}), which polykv does not "
                        "load (unpickling runs code); convert the folder to safetensors, e.g. load it once with "
                        "transformers and save_pretrained(folder, safe_serialization=True)")
        raise error(f"model {name!r}: the folder holds no weights (*.safetensors); give {FOLDER_HOLDS}")
    if not any(os.path.isfile(os.path.join(name, f)) for f in TOKENIZER_FILES):
        raise error(f"model {name!r}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save the "
                    f"model's tokenizer into it with tokenizer.save_pretrained(folder)")


def load_by_name(name: str, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 error: type[PolykvError] = PolykvError):
    """(model, tokenizer) for ``default``, a model name or a local folder (checked: :func:`check_model_folder`),
    in ``dtype`` on ``device``, eval mode, SDPA attention. Check ``device`` and ``dtype`` first with
    :func:`polykv.models.devices.check_device`."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if name == "default":
        model, tokenizer = load_default_model(dtype=torch_dtype)
    elif is_model_name(name):
        model, tokenizer = load_model(name, dtype=torch_dtype)
    else:
        check_model_folder(name, error=error, weights=True)
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, local_files_only=True,
                                                                  attn_implementation="sdpa").eval()
    return model.to(device), tokenizer
