"""CLI verbs: one module per verb, each with ``register(subparsers)``; :data:`polykv.cli.VERBS` names them (a run
imports only its verb's module, so a verb module imports what it uses at its top)."""
