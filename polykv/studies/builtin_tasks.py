"""Built-in study tasks, registered through the same hook a third-party plugin uses."""

from polykv.contract.hookspecs import hookimpl
from polykv.studies.tasks.continuation import ContinuationTask
from polykv.studies.tasks.files import LongBenchFileTask, RulerFileTask
from polykv.studies.tasks.jsonl import JsonlFileTask
from polykv.studies.tasks.niah import (NeedleMultiKeyTask, NeedleMultiQueryTask, NeedleMultiValueTask, NeedleSingleTask,
                                       NeedleTask)
from polykv.studies.tasks.passkey import PasskeyTask
from polykv.studies.tasks.variable_tracking import VariableTrackingTask
from polykv.studies.tasks.words import CommonWordsTask, FrequentWordsTask

TASKS: tuple = (
    PasskeyTask,
    NeedleTask,
    NeedleSingleTask,
    NeedleMultiKeyTask,
    NeedleMultiValueTask,
    NeedleMultiQueryTask,
    VariableTrackingTask,
    CommonWordsTask,
    FrequentWordsTask,
    ContinuationTask,
    LongBenchFileTask,
    RulerFileTask,
    JsonlFileTask,
)


@hookimpl
def register_tasks(register):
    for task in TASKS:
        register(task)
