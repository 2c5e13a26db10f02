"""Study tasks: synthetic long-context probes made offline, and loaders for benchmark files on disk.

A task is a class with ``name``, ``defaults``, ``mode``, ``make_items(tokenizer, n, seed, **params)``
and ``score(item, generated_text)``; see :mod:`polykv.studies.tasks.base`. Built-ins are listed in
:data:`polykv.studies.builtin_tasks.TASKS` and registered through the ``register_tasks`` hook.
"""

from polykv.studies.tasks.base import (GENERATE, TEACHER_FORCED, CharTokenizer, Task, TaskItem, WhitespaceTokenizer,
                                       count_tokens, prompt_length)
from polykv.studies.tasks.files import load_longbench, load_ruler
from polykv.studies.tasks.jsonl import load_jsonl

__all__ = ["Task", "TaskItem", "GENERATE", "TEACHER_FORCED", "WhitespaceTokenizer", "CharTokenizer",
           "count_tokens", "prompt_length", "load_longbench", "load_ruler", "load_jsonl"]
