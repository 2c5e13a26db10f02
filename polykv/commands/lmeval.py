"""``polykv lm-eval ARGS``: lm-evaluation-harness's command line with the ``polykv`` model registered.

lm-eval finds models only in its own table, so ``lm_eval --model polykv`` cannot see a model that
another package defines; this verb registers it, then hands every argument to lm-eval unchanged::

    polykv lm-eval --model polykv --model_args pretrained=default,plan=my.plan.json --tasks TASKS

After lm-eval's own table it prints the measured KV bytes of each polykv model it ran (also stored
in lm-eval's results under ``config.polykv``). See docs/integrations.md.
"""

from __future__ import annotations

import argparse
import sys

from polykv.errors import PolykvError


def register(subparsers) -> None:
    # prefix_chars="+": every "-" argument is lm-eval's, so this parser keeps none of them for itself
    p = subparsers.add_parser(
        "lm-eval", add_help=False, prefix_chars="+",
        help="run lm-evaluation-harness with the polykv model (--model polykv)",
        description="lm-eval's command line (all arguments passed through; --help shows lm-eval's) with the "
                    "'polykv' model registered: --model polykv --model_args pretrained=default,plan=PLAN.json")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate

        from polykv.integrations import lm_harness
    except ImportError:
        raise PolykvError("lm-evaluation-harness is not installed; install it with: "
                          "pip install 'polykv-compose[lm-eval]'") from None
    argv = check_polykv_model(args.lm_eval_args, lm_harness)
    before = len(lm_harness.PolykvLM.instances)
    saved = sys.argv
    sys.argv = ["polykv lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # lm-eval's --help, or its own argument errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    finally:
        sys.argv = saved
    for lm in lm_harness.PolykvLM.instances[before:]:
        print(lm.kv_report())
    return 0


def check_polykv_model(argv: list[str], lm_harness) -> list[str]:
    """With ``--model polykv``: check its ``--model_args`` (and ``--device``, ``--batch_size``) before lm-eval starts,
    so a bad one is one line and not lm-eval's log; without ``--device``, add ``--device cpu`` (polykv's default
    everywhere; lm-eval's own is cuda:0). Returns the arguments for lm-eval."""
    from lm_eval.utils import simple_parse_args_string

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model", "-m")
    p.add_argument("--model_args", "--model-args", "-a", default="")
    p.add_argument("--device")
    p.add_argument("--batch_size", "--batch-size", "-b")
    known, _ = p.parse_known_args(argv)
    if known.model != "polykv":
        return argv
    model_args = simple_parse_args_string(known.model_args) if isinstance(known.model_args, str) else {}
    given = {"device": known.device, "batch_size": known.batch_size}
    lm_harness.check_args(**{**{k: v for k, v in given.items() if v is not None}, **model_args})
    return argv if known.device is not None else [*argv, "--device", "cpu"]
