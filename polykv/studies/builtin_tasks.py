"""Built-in study tasks, registered through the same hook a third-party plugin uses."""

from polykv.hookspecs import hookimpl

TASKS: tuple = ()


@hookimpl
def register_tasks(register):
    for task in TASKS:
        register(task)
