"""slime's `slime.utils.http_utils.init_http_client(args)`: sizes the connections `post` holds
open to `--sglang-server-concurrency` × engines, as slime sizes its client; a generate that calls
it before posting trains (tests/plugins/slime_http_client.py). And slime's helpers for a plug-in's
own server: `get_host_info`, `find_available_port`, `is_port_available`."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from slime.utils import http_utils

from unit.compat.tiny_runs import tiny_run


def test_init_sizes_the_sessions_made_after_it(monkeypatch):
    monkeypatch.setattr(http_utils, "_connection_limit", http_utils._connection_limit)
    args = SimpleNamespace(sglang_server_concurrency=7, rollout_num_gpus=2, rollout_num_gpus_per_engine=1)
    http_utils.init_http_client(args)

    async def limit() -> int:
        try:
            return http_utils._session().connector.limit
        finally:
            await http_utils.close_sessions()

    assert asyncio.run(limit()) == 14


def test_a_generate_that_inits_the_client_trains(tmp_path):
    tiny_run(
        tmp_path, 1, "--custom-generate-function-path", "slime_http_client.generate", "--sglang-server-concurrency", "9"
    )


def test_host_info_and_a_free_port_for_a_plugins_own_server(monkeypatch):
    monkeypatch.setenv("SLIME_HOST_IP", "10.1.2.3")
    assert http_utils.get_host_info()[1] == "10.1.2.3"
    monkeypatch.delenv("SLIME_HOST_IP")
    host, ip = http_utils.get_host_info()
    assert host and ip.count(".") == 3
    port = http_utils.find_available_port(20000)
    assert 20100 <= port <= 21000 or not port >= 20100  # stepped on from a taken one
    with socket.socket() as held:
        held.bind(("", port))
        held.listen(1)
        assert not http_utils.is_port_available(port)
    assert http_utils.is_port_available(port)
