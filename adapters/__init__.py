"""Built-in operator adapters, installed as ``polykv.adapters`` (never as a top-level ``adapters``)."""
