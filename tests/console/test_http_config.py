"""Where the console listens (`--http`, `--http-token`), and that a token is asked for."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.console.conftest import Console
from zbroker.supervisor import BrokerConfig, free_port_block


@pytest.mark.parametrize("config, address", [
    (BrokerConfig(), ("127.0.0.1", 7480)),
    (BrokerConfig(port=9000), ("127.0.0.1", 9080)),
    (BrokerConfig(host="0.0.0.0", advertise_host="b.example"), ("127.0.0.1", 7480)),
    # a non-loopback host without a token: the console stays on loopback
    (BrokerConfig(host="10.1.2.3"), ("127.0.0.1", 7480)),
    (BrokerConfig(host="10.1.2.3", http_token="t"), ("10.1.2.3", 7480)),
    (BrokerConfig(http="127.0.0.2:8080"), ("127.0.0.2", 8080)),
    (BrokerConfig(http="[::1]:8080"), ("::1", 8080)),
    (BrokerConfig(http="off"), None),
    (BrokerConfig(http="OFF"), None),
])
def test_http_address(config, address):
    assert config.http_address() == address
    assert config.http_error() is None


@pytest.mark.parametrize("http", ["8080", "host:", "host:99999", "host:x"])
def test_bad_http_is_refused(http):
    assert "HOST:PORT or off" in BrokerConfig(http=http).http_error()


def test_a_non_loopback_bind_needs_a_token():
    assert "--http-token" in BrokerConfig(http="0.0.0.0:8080").http_error()
    assert "--http-token" in BrokerConfig(http="console.example:8080").http_error()
    assert BrokerConfig(http="0.0.0.0:8080", http_token="s3cret").http_error() is None


@pytest.mark.processes
def test_up_refuses_a_non_loopback_console_without_token(tmp_path):
    import subprocess
    import sys
    port = free_port_block(3)
    proc = subprocess.run([sys.executable, "-m", "zbroker", "up", "--data", str(tmp_path / "d"), "--port", str(port),
                           "--http", "0.0.0.0:8080"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "error: CONFIG: --http 0.0.0.0:8080 is not a loopback address: give --http-token" in proc.stderr


@pytest.mark.processes
def test_the_console_asks_for_its_token(start):
    http_port = free_port_block(1)
    start(http=f"127.0.0.1:{http_port}", http_token="s3cret")
    console = Console(f"http://127.0.0.1:{http_port}", token="s3cret")
    console.wait_ready()
    for path in ("/metrics", "/", "/groups"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=5)
        assert err.value.code == 401
        err.value.close()
    wrong = Console(console.base, token="nope")
    with pytest.raises(urllib.error.HTTPError) as err:
        wrong.get("/metrics")
    assert err.value.code == 401
    err.value.close()
    assert "zbroker_actor_up" in console.get("/metrics")
