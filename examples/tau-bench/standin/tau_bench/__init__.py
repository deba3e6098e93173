"""A stand-in for the `tau_bench` package (github.com/sierra-research/tau-bench), for tests and
local runs of vllm-project/vime's tau-bench agent (vLLM's vime, built on slime: the project vime
started from) without the real package or an LLM user.

It exposes the names the agent's files (`generate_with_tau.py`, `trainable_agents.py`) and its
`tau1_mock.py` import, with the same shapes: `tau_bench.types` (`Action`, `RunConfig`, the env's
responses, `RESPOND_ACTION_NAME`), `tau_bench.agents.tool_calling_agent.RESPOND_ACTION_NAME`,
`tau_bench.envs.get_env` and `tau_bench.envs.user` (the retry knobs the agent sets). Behind them is
a toy shop, not tau-bench's retail data: three tools over a four-order database, a user who says
the lines of its task's instruction in order and then `###STOP###` (no LLM, whatever the user
strategy or model asked for), and tau-bench's reward rule: 1.0 when the database ends as the
task's own actions leave it and every expected output was said to the user, else 0.0.
Put `examples/tau-bench/standin` on PYTHONPATH to use it; it is not tau-bench's benchmark.
"""
