"""Studies: compare plans head-to-head on tasks at matched memory."""
