"""Built-in plugins (retention rules and quantizers), installed as ``polykv.adapters`` (never as a top-level ``adapters``)."""
