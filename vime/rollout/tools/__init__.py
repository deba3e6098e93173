"""Tools a model may call in a multi-turn rollout: the calls, the sandbox of the python tool, the
worker processes of user tools, and the multi-turn generate that drives them."""
