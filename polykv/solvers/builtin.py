"""Built-in solvers, registered through the same hook a third-party plugin uses."""

from polykv.contract.hookspecs import hookimpl
from polykv.solvers.exact import Exact
from polykv.solvers.global_budget import GlobalBudget
from polykv.solvers.greedy import MoendGreedy
from polykv.solvers.pyramid import Pyramid
from polykv.solvers.refine import Refine
from polykv.solvers.route import ProfileRoute, RandomPlacement
from polykv.solvers.uniform import QuantOnly, Uniform

SOLVERS: tuple = (Uniform, MoendGreedy, QuantOnly, Exact, Pyramid, ProfileRoute, RandomPlacement, Refine,
                  GlobalBudget)


@hookimpl
def register_solvers(register):
    for solver in SOLVERS:
        register(solver)
