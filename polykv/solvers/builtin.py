"""Built-in solvers, registered through the same hook a third-party plugin uses."""

from polykv.hookspecs import hookimpl

SOLVERS: tuple = ()


@hookimpl
def register_solvers(register):
    for solver in SOLVERS:
        register(solver)
